"""Reading and writing calibration files, and reading the entry a config's ``CalibrationRef`` names."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from staleflow.calibration.fit import CalibrationError
from staleflow.calibration.schema import CalibrationEntry, CalibrationFile
from staleflow.config.calibration import CalibrationRef
from staleflow.config.cost import CostCoefficients
from staleflow.cost_model import CostModel


def read_calibration(path: str | os.PathLike[str]) -> CalibrationFile:
    """Parse and validate a calibration file (CalibrationError naming the problem otherwise)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise CalibrationError(
            f"calibration file {str(p)!r} does not exist (write one with `staleflow calibrate`)"
        ) from None
    try:
        return CalibrationFile.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise CalibrationError(f"calibration file {str(p)!r} is not valid: {exc}") from None


def write_calibration(path: str | os.PathLike[str], entry: CalibrationEntry) -> CalibrationFile:
    """Add or replace ``entry`` (by model and parallelism) in the file, atomically."""
    p = Path(path)
    current = read_calibration(p) if p.exists() else CalibrationFile()
    entries = {model: dict(by_par) for model, by_par in current.entries.items()}
    entries.setdefault(entry.model, {})[entry.parallelism] = entry
    updated = CalibrationFile(entries=entries)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(updated.model_dump_json(indent=2) + "\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return updated


def load_entry(
    path: str | os.PathLike[str], model: str, parallelism: str = "tp1", *, allow_poor: bool = False
) -> CalibrationEntry:
    """The entry for (model, parallelism); refuses a poor fit unless ``allow_poor``."""
    file = read_calibration(path)
    by_par = file.entries.get(model)
    if by_par is None:
        known = ", ".join(sorted(file.entries)) or "none"
        raise CalibrationError(f"{str(path)!r} has no calibration for model {model!r} (models: {known})")
    entry = by_par.get(parallelism)
    if entry is None:
        known = ", ".join(sorted(by_par))
        raise CalibrationError(
            f"{str(path)!r} has no calibration for model {model!r} with parallelism {parallelism!r} (has: {known})"
        )
    if not entry.ok and not allow_poor:
        raise CalibrationError(
            f"the calibration of {model!r} / {parallelism!r} is a poor fit ({'; '.join(entry.problems)}); "
            "re-run `staleflow calibrate` or pass allow_poor=True"
        )
    return entry


def load_calibration(
    path: str | os.PathLike[str], model: str, parallelism: str = "tp1", *, allow_poor: bool = False
) -> CostModel:
    """The calibrated ``CostModel`` for (model, parallelism) from a calibration file."""
    return load_entry(path, model, parallelism, allow_poor=allow_poor).cost.cost_model()


def referenced_entry(ref: CalibrationRef) -> CalibrationEntry:
    """The entry a config's ``calibration:`` names (CalibrationError naming the problem otherwise)."""
    file = read_calibration(ref.file)
    model = ref.model or _only(file.entries, f"{str(ref.file)!r} holds models", "model")
    parallelism = ref.parallelism
    if parallelism is None and model in file.entries:
        parallelism = _only(file.entries[model], f"model {model!r} has parallelisms", "parallelism")
    return load_entry(ref.file, model, parallelism or "tp1", allow_poor=ref.allow_poor)


def resolved_cost(cost: CostCoefficients, calibration: CalibrationRef | None) -> CostCoefficients:
    """A service's cost-model coefficients: the ``calibration`` entry's (read now) or ``cost``."""
    return referenced_entry(calibration).cost if calibration is not None else cost


def _only(keys: dict[str, Any], what: str, field: str) -> str:
    if len(keys) == 1:
        return next(iter(keys))
    raise CalibrationError(f"{what} {sorted(keys) or 'none'}: name the one to use with calibration.{field}")


def entry_summary(entry: CalibrationEntry) -> dict[str, Any]:
    """The headline numbers of an entry, flat (for tables and logs)."""
    q = entry.quality
    return {
        **entry.cost.model_dump(), "crossover_n": entry.crossover_n, "regime": entry.regime,
        "r2": q.r2, "mape": q.mape, "holdout_mape": q.holdout_mape, "samples": q.samples, "ok": entry.ok,
    }
