"""Staleness vs convergence (the paper's Figure 14): which jobs to run, and what each one shows.

The experiment runs the same job at several staleness bounds and, for contrast, once without an
effective bound: ``eta = steps``, so no trajectory can ever be refused for being too old, the
trajectory server keeps ``(steps + 1) x B`` groups in flight from the start, and the selective
synchronization never has to pull (every waiting trajectory may still run at the instance's
version). That run trains on what the initial policy generated, however old it gets: it breaks
the per-trajectory bound the other runs keep. Pure: no I/O, no processes (the CLI runs the plan).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WINDOW = 5  # steps averaged at each end of a reward curve


@dataclass(frozen=True)
class PlannedRun:
    label: str
    eta: int
    state_dir: Path
    bounded: bool  # False: the contrast run without an effective staleness bound

    def up_arguments(self, steps: int, seed: int) -> list[str]:
        """The `staleflow up` arguments of this run (the job file and other flags come on top)."""
        return ["--eta", str(self.eta), "--steps", str(steps), "--seed", str(seed),
                "--state-dir", str(self.state_dir), "--fresh", "--json-log"]


def staleness_plan(etas: Sequence[int], steps: int, out: Path, unbounded: bool = True) -> list[PlannedRun]:
    """One run per bound in ``etas`` (kept in the order given, duplicates dropped), then the
    unbounded contrast run (``eta = steps``) if asked for."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    if any(e < 0 for e in etas):
        raise ValueError(f"staleness bounds must be >= 0, got {list(etas)}")
    if not etas and not unbounded:
        raise ValueError("nothing to run: give at least one bound or keep the unbounded run")
    runs: list[PlannedRun] = []
    for eta in dict.fromkeys(etas):
        runs.append(PlannedRun(f"eta = {eta}", eta, out / f"eta{eta}", True))
    if unbounded:
        runs.append(PlannedRun(f"no bound (eta = steps = {steps})", steps, out / "unbounded", False))
    return runs


def window_mean(values: Sequence[float], first: bool, window: int = WINDOW) -> float:
    part = values[:window] if first else values[-window:]
    return sum(part) / len(part) if part else 0.0


def run_numbers(run: PlannedRun, steps: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> dict:
    """What one run shows: its reward curve (per step and against wall time), the mean reward of
    its first and last ``WINDOW`` steps, its throughput and the staleness it trained on."""
    rewards = [float(s["mean_reward"]) for s in steps]
    staleness: dict[str, int] = {}
    for s in steps:
        for k, n in s["staleness"].items():
            staleness[str(k)] = staleness.get(str(k), 0) + int(n)
    first, last = window_mean(rewards, True), window_mean(rewards, False)
    return {
        "label": run.label,
        "eta": run.eta,
        "bounded": run.bounded,
        "state_dir": str(run.state_dir),
        "steps": len(steps),
        "rewards": rewards,
        "finished_at": [float(s["finished_at"]) for s in steps],
        f"first_{WINDOW}": first,
        f"last_{WINDOW}": last,
        "rise": last - first,
        "wall_seconds": float(summary.get("wall_seconds", steps[-1]["finished_at"] if steps else 0.0)),
        "tokens_per_second": float(summary.get("tokens_per_second", 0.0)),
        "response_tokens": int(summary.get("response_tokens", sum(int(s["response_tokens"]) for s in steps))),
        "staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "max_staleness": max((int(k) for k in staleness), default=0),
        "staleness_violations": int(summary.get("staleness_violations", 0)),
    }
