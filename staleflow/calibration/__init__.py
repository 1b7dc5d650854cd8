"""Calibration: fitting the cost model to an engine and the calibration file.

* ``fit``: the pure fits (decode-step latency, KV footprint, prefill), no I/O;
* ``schema``: the calibration file's models and ``build_entry``;
* ``files``: reading and writing calibration files, and the entry a config's ``CalibrationRef`` names;
* ``profile``: the engine-driving probes and the measurement driver (imports the engines, so it
  is not re-exported here);
* ``run``: the steps of ``staleflow calibrate``: the per-engine grids, probes, profiling and fitting,
  the fit as a JSON document (imports ``profile``);
* ``plot``: measured vs estimated throughput as PNG (matplotlib);
* ``cpu``: the ``/proc`` meter of other processes' CPU use.
"""

from staleflow.calibration.files import (
    entry_summary,
    load_calibration,
    load_entry,
    read_calibration,
    referenced_entry,
    resolved_cost,
    write_calibration,
)
from staleflow.calibration.fit import (
    PAPER_MAPE,
    CalibrationError,
    DecodeFit,
    DecodeReport,
    DecodeSample,
    FitMetrics,
    bootstrap_spread,
    fit_decode,
    fit_kv_footprint,
    fit_prefill,
    fit_step_latency,
    fold_points,
    metrics,
    score,
)
from staleflow.calibration.schema import CalibrationEntry, CalibrationFile, FitQuality, ProfileGridInfo, Thresholds, build_entry, judge

__all__ = [
    "PAPER_MAPE",
    "CalibrationEntry",
    "CalibrationError",
    "CalibrationFile",
    "DecodeFit",
    "DecodeReport",
    "DecodeSample",
    "FitMetrics",
    "FitQuality",
    "ProfileGridInfo",
    "Thresholds",
    "bootstrap_spread",
    "build_entry",
    "entry_summary",
    "fit_decode",
    "fit_kv_footprint",
    "fit_prefill",
    "fit_step_latency",
    "fold_points",
    "judge",
    "load_calibration",
    "load_entry",
    "metrics",
    "read_calibration",
    "referenced_entry",
    "resolved_cost",
    "score",
    "write_calibration",
]
