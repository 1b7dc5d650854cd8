"""A version on disk: ``state_dir/versions/vNNNNNNNNNN/`` holds the safetensors file and its
``manifest.json`` (written last, then the folder renamed into place), and how such a folder is
read back and checked, and written atomically."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from staleflow.servers.params.rules import StoredVersion
from staleflow.transports.errors import FormatError
from staleflow.transports.layout import Manifest, parse_safetensors_header

DATA_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
VERSION_DIR = re.compile(r"^v(\d{10})$")


def load_version(directory: Path, version: int) -> StoredVersion:
    """A stored version whose manifest, file size and safetensors header agree, else FormatError."""
    manifest = Manifest.from_json(json.loads((directory / MANIFEST_FILE).read_text()))
    expected = manifest.data_offset + manifest.total_bytes
    fd = os.open(directory / DATA_FILE, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if manifest.version != version or size != expected:
            raise FormatError(f"data file is {size} bytes, the manifest of version {manifest.version} says {expected}")
        data_offset, tensors, _ = parse_safetensors_header(os.pread(fd, manifest.data_offset, 0))
        if data_offset != manifest.data_offset or tuple(tensors) != tuple(sorted(manifest.tensors, key=lambda t: t.offset)):
            raise FormatError("the file's safetensors header disagrees with the manifest")
    except BaseException:
        os.close(fd)
        raise
    return StoredVersion(manifest, fd, expected, directory=directory, persisted=True)


def write_atomically(path: Path, data: bytes, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.rename(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
