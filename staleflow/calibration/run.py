"""The steps of ``staleflow calibrate`` (docs/calibrate.md): the per-engine profiling grids, the engine
probes, profiling and fitting, and the fit as one JSON document (``calibration_document``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from staleflow.calibration.engine_setup import EngineSetupError, VllmSettings, vllm_settings
from staleflow.calibration.fit import CalibrationError, DecodeReport
from staleflow.calibration.profile import (
    Probe,
    SimProbe,
    VllmProbe,
    entry_from_profile,
    kv_bytes_per_token_of,
    profile,
    read_model_config,
)
from staleflow.calibration.schema import CalibrationEntry
from staleflow.config.calibration import ProfileConfig
from staleflow.config.engines import SimParams
from staleflow.cost_model import CostModel
from staleflow.engines.base import EngineError
from staleflow.host import has_cuda, meminfo_bytes

COEFFICIENTS = ("k1", "k2", "k3", "k4", "k5", "kv_budget")

# Per-engine grids. The simulator is profiled on its virtual clock, so its grid is dense and its
# intervals long (k2 and k4 are differences of intercepts: they need many points to pin down); vLLM
# is measured in wall time, so its grid is what a CPU run affords in a few minutes.
SIM_GRID = ProfileConfig(
    n_values=(1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256),
    contexts=(256, 1024, 4096, 16384),
    samples_per_point=6,
    steps_per_sample=2048,
)
VLLM_GRID = ProfileConfig(
    n_values=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128),
    contexts=(128, 512, 1536),
    samples_per_point=6,
    steps_per_sample=48,
    min_sample_seconds=0.1,
    max_sample_seconds=1.0,
    passes=2,
    trim=1.5,
    max_foreign_load=0.3,
    retries=4,
    subtract_wait=True,
    prefill_contexts=(128, 512, 1024, 2048),
    prefill_reps=2,
    weight_loads=2,
)


def sim_probe(cost: dict[str, float], noise: float, seed: int, prefill: float, max_running: int) -> tuple[Probe, dict]:
    """The simulated engine with these true coefficients, and the truth the fit should recover.
    Raises ``ValueError`` on settings the simulator refuses (negative coefficients or noise)."""
    params = SimParams(cost=CostModel(**cost), noise=noise, seed=seed, prefill_seconds_per_token=prefill,
                       max_running=max_running)
    truth = {**cost, "noise": noise, "prefill_seconds_per_token": prefill, "weight_load_seconds": params.pull_seconds()}
    return SimProbe.create(params), truth


def vllm_probe(model: Path, dtype: str, max_model_len: int | None, kv_cache_gib: int | None,
               max_num_seqs: int | None, enforce_eager: bool, cpu_threads: int | None = None,
               largest_n: int = max(VLLM_GRID.n_values)) -> tuple[Probe, VllmSettings]:
    """vLLM on a local model directory, with ``max_model_len`` and (CPU builds) the KV cache derived
    from the model and the free memory where not given (``engine_setup``); its logs go to stderr.
    ``cpu_threads``: CPU builds only, the engine core's OpenMP threads, unpinned (see
    docs/calibrate.md). Raises ``EngineSetupError`` for settings vLLM would refuse."""
    from staleflow.config.engines import VllmEngineParams

    config = read_model_config(str(model))
    settings = vllm_settings(config, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                             kv_bytes_per_token=kv_bytes_per_token_of(config, dtype), largest_n=largest_n,
                             cpu=not has_cuda(), kv_space_set="VLLM_CPU_KVCACHE_SPACE" in os.environ,
                             free_bytes=meminfo_bytes("MemAvailable"))
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the report / --json
    if cpu_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    params = VllmEngineParams(model=str(model), dtype=dtype, max_model_len=settings.max_model_len,
                              kv_cache_gib=settings.kv_cache_gib, max_num_seqs=max_num_seqs,
                              enforce_eager=enforce_eager)
    return VllmProbe.create(params), settings


async def profile_and_fit(
    probe: Probe, config: ProfileConfig, progress: Callable[[int, int, str], None],
    stopping: Callable[[], None] = lambda: None, **fit: Any,
) -> tuple[CalibrationEntry, DecodeReport]:
    """Start the engine, profile it over ``config``'s grid (``progress(done, total, what)`` after
    each step), stop it (``stopping()`` first) and fit (``fit``: ``entry_from_profile``'s keywords)."""
    try:
        await probe.start()
    except (CalibrationError, EngineError):
        raise
    except Exception as exc:  # vLLM raises what it likes at start-up; say it once, with what to check
        raise EngineSetupError(f"the {probe.engine_name} engine did not start: {_first_line(exc)}",
                               START_FIX.get(probe.engine_name, "see the engine's log above")) from exc
    try:
        data = await profile(probe, config, progress)
    finally:
        stopping()
        await probe.close()
    return entry_from_profile(data, config, **fit)


START_FIX = {"vllm": "vLLM's log above says why; check --model (a Hugging Face model directory), --dtype, "
                     "--max-model-len (at most the model's positions) and --kv-cache-gib (CPU: at most the free "
                     "memory), or leave them out to derive them"}


def _first_line(exc: BaseException) -> str:
    """What an exception says, in one line (a pydantic error: each field and its message)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            details: Any = errors()
            return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in details)
        except (TypeError, KeyError):
            pass
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__


def calibration_document(entry: CalibrationEntry, report: DecodeReport, out: Path, written: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {"calibration": entry.model_dump(mode="json"), "out": str(out) if written else None}
    if entry.truth:
        fitted = entry.cost.model_dump()
        doc["recovery"] = {k: fitted[k] / entry.truth[k] - 1 for k in COEFFICIENTS if entry.truth.get(k)}
        doc["recovery_max_abs"] = max(abs(v) for k, v in doc["recovery"].items() if k in ("k1", "k2", "k3", "k4"))
    doc["samples"] = [
        {"n": s.n, "kv": s.kv, "steps": s.steps, "point": s.point, "latency": s.latency, "predicted": p,
         "throughput": s.n / s.latency, "predicted_throughput": s.n / p, "fold": report.folds.get(s.point),
         "cv_predicted": cv}
        for s, p, cv in zip(report.samples, report.predicted, report.cv_predicted or [None] * len(report.samples),
                            strict=True)
    ]
    return doc


def crossover_text(entry: CalibrationEntry) -> str:
    if entry.crossover_n is None:
        return ": none observed (memory-bound throughout)"
    if entry.regime == "compute-bound only":
        return f" <= {entry.crossover_n:g} (compute-bound throughout)"
    return f" = {entry.crossover_n:.1f}"
