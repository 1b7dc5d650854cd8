"""safetensors dtypes: their widths, and their numpy equivalents."""

from __future__ import annotations

import numpy as np

from staleflow.transports.errors import FormatError

# safetensors dtype names and their widths in bytes
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

_NUMPY_TO_ST = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16", np.dtype(np.uint16): "U16", np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32", np.dtype(np.uint32): "U32", np.dtype(np.float32): "F32",
    np.dtype(np.int64): "I64", np.dtype(np.uint64): "U64", np.dtype(np.float64): "F64",
}
_ST_TO_NUMPY = {v: k for k, v in _NUMPY_TO_ST.items()}
# numpy has no bfloat16 / float8: ml_dtypes provides them where installed
_EXTENDED = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_SAME_WIDTH_UINT = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}



def _ml_dtype(name: str) -> np.dtype | None:
    try:
        import ml_dtypes  # pyright: ignore[reportMissingImports]  (optional: installed with some model stacks)
    except ImportError:
        return None
    return np.dtype(getattr(ml_dtypes, name))


def numpy_dtype(st_dtype: str) -> np.dtype:
    """The numpy dtype for a safetensors dtype. BF16 / F8 need ``ml_dtypes``; without it they come
    back as the unsigned integer of the same width (the raw bits; the manifest keeps the real dtype)."""
    if st_dtype in _ST_TO_NUMPY:
        return _ST_TO_NUMPY[st_dtype]
    if st_dtype in _EXTENDED:
        return _ml_dtype(_EXTENDED[st_dtype]) or _SAME_WIDTH_UINT[DTYPE_SIZES[st_dtype]]
    raise FormatError(f"unknown dtype {st_dtype!r}; known: {', '.join(DTYPE_SIZES)}")


def safetensors_dtype(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype in _NUMPY_TO_ST:
        return _NUMPY_TO_ST[dtype]
    for st_name, ml_name in _EXTENDED.items():
        if dtype.name == ml_name:
            return st_name
    raise FormatError(f"numpy dtype {dtype} has no safetensors equivalent; convert it first")
