"""Experiment tracking: per-step metrics of a job to the console, TensorBoard, W&B and MLflow.

The job's ``logger`` setting (``staleflow.config.logger.LoggerConfig``) names the backends; each but
the console is an optional extra (``pip install 'staleflow[tensorboard]'``, ``[wandb]``, ``[mlflow]``).
Everything is written locally: TensorBoard event files, a W&B run in offline mode (``wandb sync`` uploads it
later), an MLflow file store. Every backend gets the same metric names (``step_metrics``):

* ``reward/{mean,std,min,max}``, ``length/{mean,min,max}``, ``tokens/response``
* ``staleness/{mean,max}`` and ``staleness/count_{k}`` (V_buf - V_traj = k), plus a histogram
  where the backend has them (TensorBoard, W&B)
* ``train/*``: whatever the trainer reports (loss, grad_norm, importance_weight_mean / _max,
  truncated_fraction, clipped_fraction, negative_logp, advantage_abs_mean, kl, seconds); the FSDP2
  trainer adds its step's ``step_seconds``, ``tokens_per_second`` (trained prompt + response tokens
  per second of the step), ``peak_memory_bytes`` (rank 0: allocated GPU memory, or the process's RSS
  on CPU) and, on a GPU of known peak, ``mfu`` (``staleflow.training.bench.MeteredBackend``)
* ``throughput/tokens_per_second`` (this step) and ``throughput/tokens_per_second_cumulative``
* ``instance/{id}/{running,waiting,version}`` at the step's end
* ``control/decision_ms`` (mean planning time of the coordinator's cycles during the step),
  ``control/cycles``, ``control/{kind}_ms`` (mean command latency by kind during the step)
* ``length_skew/*``: what the staleness bound did to the response lengths in the step's window
  (``staleflow.length_skew``): ``{generated,trained,aborted,filtered,dropped}`` trajectories,
  ``{generated,trained}_mean`` lengths and ``trained_over_generated_mean``, ``regenerated_tokens``,
  ``admission_waited`` and ``admission_wait_mean_s``, ``staleness_mean/{bucket}``; histograms
  ``length_skew/generated`` and ``length_skew/trained`` over the power-of-two length buckets
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, get_args

from staleflow.config.logger import LoggerBackend

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = get_args(LoggerBackend)
EXTRA = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""backend -> (module it needs, the pyproject extra that installs it)"""

Scalars = dict[str, float]
Histograms = dict[str, dict[int, int]]


class TrackingUnavailable(RuntimeError):
    """A configured backend's package is not installed."""


def missing_backends(backends: tuple[str, ...] | list[str]) -> list[str]:
    """Messages for the configured backends whose package is not installed."""
    missing = []
    for backend in backends:
        if backend in EXTRA and importlib.util.find_spec(EXTRA[backend][0]) is None:
            module, extra = EXTRA[backend]
            missing.append(f"the {backend} logger needs {module}: pip install 'staleflow[{extra}]'")
    return missing


# ---------------------------------------------------------------------------- what is logged


def step_metrics(step: Mapping[str, Any], previous: Mapping[str, Any] | None, sample: Mapping[str, Any] | None = None,
                 control: Mapping[str, Any] | None = None, control_before: Mapping[str, Any] | None = None,
                 cumulative_tokens: int | None = None, time_scale: float = 1.0,
                 length_skew: Mapping[str, Any] | None = None) -> tuple[Scalars, Histograms]:
    """The scalars and histograms of one training step.

    ``step``/``previous``: the step's record and the one before (``StepRecord`` as a dict);
    ``sample``: the job's latest view of the instances (``{id: {running, waiting, version}}``);
    ``control``/``control_before``: the coordinator's ``/v1/coordinator`` now and at the previous
    step (so its times are per step); ``cumulative_tokens``: response tokens trained up to and
    including this step; ``time_scale``: engine seconds per wall second (the sim clock's speed), so
    tokens/s are on the engine's clock as in the run's summary; ``length_skew``: the step's window
    of the length-skew accounting (an entry of ``LengthSkew.to_json()["per_step"]``)."""
    scalars: Scalars = {}
    rewards = step.get("rewards") or {}
    scalars["reward/mean"] = float(step["mean_reward"])
    for key in ("std", "min", "max"):
        if key in rewards:
            scalars[f"reward/{key}"] = float(rewards[key])
    scalars["length/mean"] = float(step["mean_length"])
    scalars["length/max"] = float(step["max_length"])
    if "min_length" in step:
        scalars["length/min"] = float(step["min_length"])
    scalars["tokens/response"] = float(step["response_tokens"])
    scalars["trajectories"] = float(step["trajectories"])
    staleness = {int(k): int(v) for k, v in step["staleness"].items()}
    total = sum(staleness.values())
    if total:
        scalars["staleness/mean"] = sum(k * n for k, n in staleness.items()) / total
        scalars["staleness/max"] = float(max(k for k, n in staleness.items() if n))
    for k, n in sorted(staleness.items()):
        scalars[f"staleness/count_{k}"] = float(n)
    scalars["train/seconds"] = float(step.get("train_seconds", 0.0))
    for key, value in (step.get("metrics") or {}).items():
        scalars[f"train/{key}"] = float(value)
    finished = float(step["finished_at"]) * time_scale
    before = float(previous["finished_at"]) * time_scale if previous else 0.0
    if finished > before:
        scalars["throughput/tokens_per_second"] = float(step["response_tokens"]) / (finished - before)
    scalars["time/seconds"] = finished  # since the run started, on the engine's clock
    if finished > 0 and cumulative_tokens is not None:
        scalars["throughput/tokens_per_second_cumulative"] = cumulative_tokens / finished
    for instance_id, view in sorted((sample or {}).items()):
        for key in ("running", "waiting", "version"):
            if view.get(key) is not None:
                scalars[f"instance/{instance_id}/{key}"] = float(view[key])
    if control:
        scalars.update(_control_metrics(control, control_before or {}))
    histograms: Histograms = {"staleness": staleness}
    if length_skew:
        skew_scalars, skew_histograms = _length_skew_metrics(length_skew)
        scalars.update(skew_scalars)
        histograms.update(skew_histograms)
    return {k: v for k, v in scalars.items() if math.isfinite(v)}, histograms


def _length_skew_metrics(window: Mapping[str, Any]) -> tuple[Scalars, Histograms]:
    from staleflow.length_skew import FATES, bucket_of

    def by_bucket(counts: Mapping[str, int]) -> dict[int, int]:  # bucket label -> its index
        return {bucket_of(int(label.split("-")[0])): int(n) for label, n in counts.items()}

    out: Scalars = {"length_skew/generated": float(sum(window["generated"].values()))}
    for fate in FATES:
        out[f"length_skew/{fate.value}"] = float(sum(window[fate.value].values()))
    for key in ("generated_mean", "trained_mean"):
        if window.get(key) is not None:
            out[f"length_skew/{key}"] = float(window[key])
    if window.get("generated_mean") and window.get("trained_mean") is not None:
        out["length_skew/trained_over_generated_mean"] = window["trained_mean"] / window["generated_mean"]
    out["length_skew/regenerated_tokens"] = float(sum(window["regenerated_tokens"].values()))
    out["length_skew/admission_waited"] = float(window["admission"]["waited"])
    out["length_skew/admission_wait_mean_s"] = float(window["admission"]["mean_wait_s"])
    for label, mean in window["staleness_mean"].items():
        out[f"length_skew/staleness_mean/{label}"] = float(mean)
    return out, {"length_skew/generated": by_bucket(window["generated"]),
                 "length_skew/trained": by_bucket(window["trained"])}


def _control_metrics(now: Mapping[str, Any], before: Mapping[str, Any]) -> Scalars:
    out: Scalars = {}
    decisions = now.get("decisions", 0) - before.get("decisions", 0)
    if decisions > 0:
        out["control/decision_ms"] = (now.get("decision_ms_total", 0.0) - before.get("decision_ms_total", 0.0)) / decisions
    out["control/cycles"] = float(now.get("cycles", 0) - before.get("cycles", 0))
    counts, seconds = now.get("command_count") or {}, now.get("command_seconds") or {}
    counts_before, seconds_before = before.get("command_count") or {}, before.get("command_seconds") or {}
    for kind, n in counts.items():
        issued = n - counts_before.get(kind, 0)
        if issued > 0:
            out[f"control/{kind}_ms"] = 1e3 * (seconds.get(kind, 0.0) - seconds_before.get(kind, 0.0)) / issued
    return out


# ---------------------------------------------------------------------------- backends


class Sink(Protocol):
    def log(self, step: int, scalars: Scalars, histograms: Histograms) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One line per step through ``write`` (the job's console or its JSON log)."""

    KEYS = (("reward", "reward/mean", "{:.3f}"), ("len", "length/mean", "{:.1f}"), ("loss", "train/loss", "{:.4f}"),
            ("grad", "train/grad_norm", "{:.3f}"), ("iw", "train/importance_weight_mean", "{:.3f}"),
            ("stale", "staleness/mean", "{:.2f}"), ("tok/s", "throughput/tokens_per_second", "{:,.0f}"),
            ("decide", "control/decision_ms", "{:.2f} ms"))

    def __init__(self, write: Callable[[str], None]):
        self.write = write

    def log(self, step: int, scalars: Scalars, histograms: Histograms) -> None:
        parts = [f"{label} {fmt.format(scalars[key])}" for label, key, fmt in self.KEYS if key in scalars]
        self.write(f"step {step}: " + "  ".join(parts))

    def close(self) -> None:
        pass


class TensorBoardSink:
    """TensorBoard event files in ``directory`` (written with tensorboard's own writer)."""

    def __init__(self, directory: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._writer = EventFileWriter(str(directory))

    def log(self, step: int, scalars: Scalars, histograms: Histograms) -> None:
        # protobuf-generated modules: their classes are made at import, so a static reader cannot see them
        from tensorboard.compat.proto.event_pb2 import Event  # pyright: ignore[reportAttributeAccessIssue]
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary  # pyright: ignore[reportAttributeAccessIssue]

        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        for name, counts in histograms.items():
            if not counts:
                continue
            keys = sorted(counts)
            n = sum(counts.values())
            proto = HistogramProto(min=float(keys[0]), max=float(keys[-1]), num=float(n),
                                   sum=float(sum(k * c for k, c in counts.items())),
                                   sum_squares=float(sum(k * k * c for k, c in counts.items())),
                                   bucket_limit=[k + 0.5 for k in keys], bucket=[float(counts[k]) for k in keys])
            values.append(Summary.Value(tag=name, histo=proto))
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run in offline mode under ``directory`` (``wandb sync`` uploads it when you want)."""

    def __init__(self, directory: Path, project: str, run_name: str | None, config: Mapping[str, Any]):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb = wandb
        self.run = wandb.init(project=project, name=run_name, dir=str(directory), mode="offline", config=dict(config),
                              settings=wandb.Settings(console="off", x_disable_stats=True))
        self.directory = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>

    def log(self, step: int, scalars: Scalars, histograms: Histograms) -> None:
        import numpy as np

        row: dict[str, Any] = dict(scalars)
        for name, counts in histograms.items():
            if counts:  # one bin per integer value from the smallest to the largest seen
                low, high = min(counts), max(counts)
                bins = np.array([counts.get(k, 0) for k in range(low, high + 1)])
                row[f"{name}/histogram"] = self._wandb.Histogram(np_histogram=(bins, np.arange(low - 0.5, high + 1.0)))
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()
        self._wandb.teardown()  # stops the wandb-core service once it has written the run out


class MlflowSink:
    """An MLflow run; by default in a local file store under ``directory``."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str | None, config: Mapping[str, Any]):
        if tracking_uri.startswith("file:"):
            # MLflow 3 keeps the directory store in maintenance mode and refuses it unless asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in sorted(flatten(config).items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, scalars: Scalars, histograms: Histograms) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"ledger": {"eta": 2}}`` -> ``{"ledger.eta": 2}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str | int | float | bool) or value is None else json.dumps(value)
    return out


# ---------------------------------------------------------------------------- the fan-out


class Tracker:
    """Sends each step to every configured backend. A backend that fails is reported once and
    dropped; the job goes on."""

    def __init__(self, sinks: Mapping[str, Sink]):
        self.sinks = dict(sinks)

    @classmethod
    def open(cls, backends: tuple[str, ...] | list[str], directory: Path, *, project: str = "staleflow",
             run_name: str | None = None, config: Mapping[str, Any] | None = None, mlflow_tracking_uri: str | None = None,
             console: Callable[[str], None] = print) -> Tracker:
        problems = missing_backends(backends)
        if problems:
            raise TrackingUnavailable("; ".join(problems))
        config = dict(config or {})
        sinks: dict[str, Sink] = {}
        for backend in dict.fromkeys(backends):
            if backend == "console":
                sinks[backend] = ConsoleSink(console)
            elif backend == "tensorboard":
                sinks[backend] = TensorBoardSink(directory / "tensorboard")
            elif backend == "wandb":
                sinks[backend] = WandbSink(directory, project, run_name, config)
            elif backend == "mlflow":
                uri = mlflow_tracking_uri or (directory / "mlruns").resolve().as_uri()
                sinks[backend] = MlflowSink(uri, project, run_name, config)
            else:
                raise ValueError(f"unknown logger backend {backend!r}; choose from {', '.join(BACKENDS)}")
        return cls(sinks)

    def log(self, step: int, scalars: Scalars, histograms: Histograms | None = None) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(step, scalars, histograms or {})
            except Exception:  # a tracking backend must not stop training
                log.exception("the %s logger failed; it is switched off for the rest of the run", name)
                self.sinks.pop(name)

    def close(self) -> None:
        for name, sink in self.sinks.items():
            try:
                sink.close()
            except Exception:  # closing one backend must not keep the others open
                log.exception("closing the %s logger failed", name)
        self.sinks.clear()


__all__ = ["BACKENDS", "Tracker", "TrackingUnavailable", "flatten", "missing_backends", "step_metrics"]
