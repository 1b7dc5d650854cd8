"""Experiment tracking backends, offline: what a job logs is read back from what each one wrote.

The backends are optional extras of StaleFlow and part of the test extra."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from staleflow.tracking import Tracker, TrackingUnavailable, missing_backends, step_metrics

STEPS = [
    {"version": 0, "finished_at": 4.0, "groups": 2, "trajectories": 8, "response_tokens": 80, "mean_reward": 0.25,
     "mean_length": 10.0, "max_length": 14, "min_length": 6, "staleness": {"0": 8}, "train_seconds": 1.5,
     "metrics": {"loss": 0.12, "grad_norm": 0.8, "importance_weight_mean": 1.0, "importance_weight_max": 1.3},
     "rewards": {"std": 0.43, "min": 0.0, "max": 1.0}},
    {"version": 1, "finished_at": 6.0, "groups": 2, "trajectories": 8, "response_tokens": 64, "mean_reward": 0.5,
     "mean_length": 8.0, "max_length": 12, "min_length": 5, "staleness": {"0": 3, "1": 4, "2": 1}, "train_seconds": 1.2,
     "metrics": {"loss": 0.05, "grad_norm": 0.6, "importance_weight_mean": 0.97, "importance_weight_max": 2.0},
     "rewards": {"std": 0.5, "min": 0.0, "max": 1.0}},
]
SAMPLE = {"inst-0": {"running": 5, "waiting": 2, "version": 1}, "inst-1": {"running": 0, "waiting": 0, "version": 0}}
CONTROL = [{"cycles": 10, "decisions": 8, "decision_ms_total": 4.0, "command_count": {"route": 4},
            "command_seconds": {"route": 0.2}},
           {"cycles": 30, "decisions": 20, "decision_ms_total": 16.0, "command_count": {"route": 10, "pull": 1},
            "command_seconds": {"route": 0.5, "pull": 2.0}}]


def log_two_steps(tracker: Tracker) -> list[dict[str, float]]:
    logged, tokens = [], 0
    for i, step in enumerate(STEPS):
        tokens += step["response_tokens"]
        scalars, histograms = step_metrics(step, STEPS[i - 1] if i else None, SAMPLE, CONTROL[i],
                                           CONTROL[i - 1] if i else None, cumulative_tokens=tokens)
        tracker.log(step["version"], scalars, histograms)
        logged.append(scalars)
    tracker.close()
    return logged


def test_step_metrics_cover_what_rl_engineers_watch() -> None:
    scalars, histograms = step_metrics(STEPS[1], STEPS[0], SAMPLE, CONTROL[1], CONTROL[0], cumulative_tokens=144)
    assert scalars["reward/mean"] == 0.5 and scalars["reward/std"] == 0.5
    assert scalars["length/mean"] == 8.0 and scalars["length/min"] == 5
    assert scalars["staleness/mean"] == pytest.approx((4 + 2) / 8) and scalars["staleness/max"] == 2
    assert scalars["staleness/count_1"] == 4 and histograms["staleness"] == {0: 3, 1: 4, 2: 1}
    assert scalars["train/loss"] == 0.05 and scalars["train/importance_weight_max"] == 2.0
    assert scalars["train/grad_norm"] == 0.6 and scalars["train/seconds"] == 1.2
    assert scalars["throughput/tokens_per_second"] == pytest.approx(64 / 2.0)
    assert scalars["throughput/tokens_per_second_cumulative"] == pytest.approx(144 / 6.0)
    assert scalars["instance/inst-0/running"] == 5 and scalars["instance/inst-1/version"] == 0
    assert scalars["control/decision_ms"] == pytest.approx(12.0 / 12)
    assert scalars["control/cycles"] == 20
    assert scalars["control/route_ms"] == pytest.approx(1e3 * 0.3 / 6) and scalars["control/pull_ms"] == 2000.0


def test_console_gets_one_line_per_step(tmp_path: Path) -> None:
    lines: list[str] = []
    log_two_steps(Tracker.open(["console"], tmp_path, console=lines.append))
    assert len(lines) == 2 and lines[1].startswith("step 1: reward 0.500") and "loss 0.0500" in lines[1]


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = log_two_steps(Tracker.open(["tensorboard"], tmp_path))
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert set(logged[1]) <= set(tags["scalars"])
    for key in ("reward/mean", "train/loss", "staleness/mean", "instance/inst-0/running", "control/decision_ms"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(i, pytest.approx(s[key])) for i, s in
                                                                    enumerate(logged) if key in s]
    histogram = events.Histograms("staleness")[-1]
    assert histogram.step == 1 and histogram.histogram_value.num == 8
    assert list(histogram.histogram_value.bucket) == [3, 4, 1]


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a W&B transaction log (.wandb): a 7-byte header, then LevelDB log blocks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, parts = 32768, 7, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            yield chunk
        elif kind == 2:  # first
            parts = [chunk]
        elif kind == 3:  # middle
            parts.append(chunk)
        elif kind == 4:  # last
            yield b"".join([*parts, chunk])


def test_wandb_offline_run_reads_back(tmp_path: Path) -> None:
    from wandb.proto import wandb_internal_pb2

    logged = log_two_steps(Tracker.open(["wandb"], tmp_path, project="staleflow-test", run_name="two-steps",
                                        config={"ledger": {"eta": 2}}))
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, project = [], {}, None
    for data in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row: dict = {}
            for item in record.history.item:  # a logged object's fields come as nested keys
                *parents, leaf = [item.key] if item.key else list(item.nested_key)
                target = row
                for parent in parents:
                    target = target.setdefault(parent, {})
                target[leaf] = json.loads(item.value_json)
            history.append(row)
        elif kind == "run":
            project = record.run.project
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    assert [row["_step"] for row in history] == [0, 1]
    for row, scalars in zip(history, logged, strict=True):
        for key in ("reward/mean", "train/loss", "throughput/tokens_per_second", "control/decision_ms"):
            assert row[key] == pytest.approx(scalars[key])
    assert history[1]["staleness/histogram"]["_type"] == "histogram"
    assert history[1]["staleness/histogram"]["values"] == [3, 4, 1]
    assert config["ledger"] == {"eta": 2} and project == "staleflow-test"


def test_mlflow_file_store_reads_back(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    tracker = Tracker.open(["mlflow"], tmp_path, project="staleflow-test", run_name="two-steps",
                           config={"ledger": {"eta": 2}, "steps": 2})
    run_id = tracker.sinks["mlflow"].run_id
    logged = log_two_steps(tracker)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"ledger.eta": "2", "steps": "2"}
    for key in ("reward/mean", "train/grad_norm", "staleness/count_1", "instance/inst-0/waiting", "control/pull_ms"):
        history = client.get_metric_history(run_id, key)
        assert [(h.step, h.value) for h in history] == [(i, pytest.approx(s[key])) for i, s in enumerate(logged)
                                                        if key in s]


def test_a_backend_that_is_not_installed_is_named_with_its_extra(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_backends(["console", "wandb"]) == ["the wandb logger needs wandb: pip install 'staleflow[wandb]'"]
    with pytest.raises(TrackingUnavailable, match=r"staleflow\[wandb\]"):
        Tracker.open(["console", "wandb"], tmp_path)
