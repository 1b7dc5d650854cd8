"""Calibration: the pure fits, the sim engine end to end through the CLI, the file format.

The vLLM test at the end runs only where vLLM is installed (see docs/calibrate.md for the venv).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from support import calibrate_cli as cli
from typer.testing import CliRunner

from staleflow.calibration import (
    CalibrationError,
    DecodeSample,
    Thresholds,
    build_entry,
    fit_decode,
    fit_kv_footprint,
    fit_prefill,
    fit_step_latency,
    fold_points,
    judge,
    load_calibration,
    load_entry,
    read_calibration,
    referenced_entry,
    resolved_cost,
    write_calibration,
)
from staleflow.calibration.profile import plan_points, trim_outliers
from staleflow.calibration.run import SIM_GRID
from staleflow.cli.calibrate import POOR_FIT_EXIT
from staleflow.config.calibration import ProfileConfig
from staleflow.cost_model import CostModel

runner = CliRunner()

# "hidden" ground truth for the simulator: not the defaults, crossover n* = 25 inside the grid
HIDDEN = CostModel(k1=1.1e-7, k2=2.5e-3, k3=1.0e-4, k4=7.0e-3, k5=2.0, kv_budget=3_000_000)
N_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CONTEXTS = (256, 1024, 4096, 16384)


def synthetic(cost: CostModel, noise: float = 0.0, per_point: int = 4, seed: int = 0,
              n_values: tuple[int, ...] = N_GRID, blocks: int = 1) -> list[DecodeSample]:
    """Step latencies of ``cost`` over an (n, context) grid with multiplicative log-normal noise.

    ``noise`` is the sigma of one noise draw, as the simulator's ``noise``; a sample averages
    ``blocks`` draws, as a measured interval averages the simulator's noise blocks of 64 steps.
    """
    rng = np.random.default_rng(seed)
    samples, point = [], 0
    for n in n_values:
        for context in CONTEXTS:
            if n * (context + 2000) > 1_700_000:
                continue
            for k in range(per_point):
                kv = n * (context + 100 + 256 * k)
                factor = np.exp(noise * rng.standard_normal(blocks) - noise**2 / 2).mean()
                samples.append(DecodeSample(n, kv, cost.step_latency(kv, n) * factor, point, steps=64 * blocks))
            point += 1
    return samples


def rel_errors(fit, truth: CostModel) -> dict[str, float]:
    return {k: abs(getattr(fit, k) / getattr(truth, k) - 1) for k in ("k1", "k2", "k3", "k4")}


# ---------------------------------------------------------------------------------------- pure fits


def test_exact_recovery_without_noise() -> None:
    truth = CostModel()  # paper Table 4: n* = 13.76
    report = fit_decode(synthetic(truth))
    assert max(rel_errors(report.fit, truth).values()) < 1e-6
    assert report.fit.regime == "both" and report.fit.crossover == pytest.approx(truth.k2 / truth.k3, rel=1e-6)
    assert report.overall.r2 == pytest.approx(1.0) and report.overall.mape < 1e-9
    assert report.holdout is not None and report.holdout.mape < 1e-9


def test_recovery_within_5_percent_with_5_percent_noise() -> None:
    """5 % noise per 64 steps, 1024-step intervals (what the sim engine is profiled with)."""
    truth = CostModel(k1=1.1e-7, k2=2.5e-3, k3=9e-5, k4=6e-3)  # n* = 27.8
    report = fit_decode(synthetic(truth, noise=0.05, per_point=6, seed=1, n_values=SIM_GRID.n_values, blocks=16))
    errors = rel_errors(report.fit, truth)
    assert max(errors.values()) < 0.05, errors
    assert report.holdout is not None and report.holdout.mape < 0.05
    # the same noise on every single sample (no averaging): predictions stay at the noise floor
    # (about 4 %) although k2, a small part of the step latency, is then only known to about 10 %
    rough = fit_decode(synthetic(truth, noise=0.05, per_point=6, seed=1, n_values=SIM_GRID.n_values))
    assert rough.holdout is not None and rough.holdout.mape < 0.06


@pytest.mark.parametrize("crossover", [6.0, 40.0, 150.0])
def test_crossover_is_found(crossover: float) -> None:
    truth = CostModel(k1=5e-8, k2=1e-4 * crossover, k3=1e-4, k4=4e-3)
    fit = fit_step_latency(synthetic(truth, noise=0.01, seed=2))
    assert fit.regime == "both"
    assert fit.crossover == pytest.approx(crossover, rel=0.1)


def test_one_sided_data_is_flagged() -> None:
    truth = CostModel()  # n* = 13.76
    memory = fit_step_latency(synthetic(truth, n_values=(1, 2, 4, 8, 12)))
    assert memory.regime == "memory-bound only" and memory.k3 == 0 and memory.crossover is None
    assert memory.k4 == pytest.approx(truth.k2 + truth.k4, rel=1e-6)  # the floor k2 + k4, reported as k4
    assert "no compute-bound regime" in memory.warnings[0]
    compute = fit_step_latency(synthetic(truth, n_values=(16, 32, 64, 128)))
    assert compute.regime == "compute-bound only" and compute.crossover == 16
    assert compute.k3 == pytest.approx(truth.k3, rel=1e-6) and compute.k4 == pytest.approx(truth.k4, rel=1e-6)
    assert "upper bound" in compute.warnings[0]


def test_poor_fit_is_detected() -> None:
    rng = np.random.default_rng(3)
    # latency that ignores the model's shape: quadratic in n, jittered by 30 %
    samples = [DecodeSample(n, n * 1000.0, 1e-3 + 1e-6 * n * n * rng.uniform(0.7, 1.3), point=i)
               for i, n in enumerate(N_GRID * 3)]
    report = fit_decode(samples)
    entry = build_entry(model="m", parallelism="tp1", engine="sim", report=report, k5=1.0, kv_r2=1.0,
                        kv_budget=1e6, thresholds=Thresholds(max_mape=0.05, min_r2=0.99))
    assert not entry.ok
    assert any("exceeds the limit" in p for p in entry.problems)
    assert judge(entry.quality, Thresholds(max_mape=10.0, min_r2=-100.0)) == []


def test_bad_input_is_refused_with_a_reason() -> None:
    with pytest.raises(CalibrationError, match="at least 4"):
        fit_step_latency([DecodeSample(1, 10.0, 0.01)] * 3)
    with pytest.raises(CalibrationError, match=">= 2 different running counts"):
        fit_step_latency([DecodeSample(4, float(kv), 0.01) for kv in range(5)])
    with pytest.raises(CalibrationError, match="step latency > 0"):
        DecodeSample(1, 0.0, -1.0)
    with pytest.raises(CalibrationError, match=">= 2 folds"):
        fold_points(synthetic(CostModel()), 1)
    with pytest.raises(CalibrationError, match="k5 needs"):
        fit_kv_footprint([])


def test_cross_validation_folds_keep_every_running_count_in_training() -> None:
    samples = synthetic(CostModel())
    folds = fold_points(samples, 4, seed=4)
    assert set(folds.values()) == {0, 1, 2, 3} and set(folds) == {s.point for s in samples}
    points_of_n: dict[int, set[int]] = {}
    for s in samples:
        points_of_n.setdefault(s.n, set()).add(s.point)
    for f in range(4):  # every n with >= 2 points keeps a training point in every fold
        trained = {s.n for s in samples if folds[s.point] != f}
        assert trained >= {n for n, points in points_of_n.items() if len(points) >= 2}
    report = fit_decode(samples, folds=4)
    assert report.holdout_points == len(folds) and all(p is not None for p in report.cv_predicted)


def test_kv_footprint_prefill_and_trimming() -> None:
    k5, r2 = fit_kv_footprint([(100, 200.0), (1000, 2000.0), (5000, 10000.0)])
    assert k5 == pytest.approx(2.0) and r2 == pytest.approx(1.0)
    # time to first token = (prefill + k1*k5) per prompt token + one step
    first_token = [(p, 0.01 + (2e-5 + 1e-7 * 2) * p) for p in (256, 1024, 4096)]
    assert fit_prefill(first_token, k1=1e-7, k5=2) == pytest.approx(2e-5)
    assert fit_prefill([(256, 0.01)]) is None
    samples = [DecodeSample(8, 1e4, lat, 0) for lat in (0.010, 0.011, 0.0105, 0.030, 0.002)]
    assert [s.latency for s in trim_outliers(samples, 1.5)] == [0.010, 0.011, 0.0105]


def test_plan_fits_the_budget_and_the_engine() -> None:
    config = ProfileConfig(n_values=(1, 64, 512), contexts=(256, 4096), samples_per_point=2, steps_per_sample=64)
    plan, notes = plan_points(config, budget_tokens=200_000, max_context=None, max_running=256)
    assert all(n * (context + max_tokens) <= 0.85 * 200_000 for n, context, max_tokens in plan)
    assert {n for n, _, _ in plan} == {1, 64} and "n = 512 skipped" in notes[0]
    plan, _ = plan_points(config, budget_tokens=1e7, max_context=1024, max_running=None)
    assert all(context + max_tokens <= 1024 for _, context, max_tokens in plan)


# ---------------------------------------------------------------------------------------- CLI, sim


def _sim_args(tmp_path: Path, *extra: str) -> list[str]:
    truth = [f"--{k.replace('_', '-')}={getattr(HIDDEN, k)}" for k in ("k1", "k2", "k3", "k4", "k5", "kv_budget")]
    return ["calibrate", "--engine", "sim", *truth, "--noise", "0.05", "--sim-seed", "7", "--bootstrap", "0",
            "--out", str(tmp_path / "calibration.json"), *extra]


def test_sim_calibration_end_to_end(tmp_path: Path) -> None:
    plot = tmp_path / "fig24.png"
    result = runner.invoke(cli(), _sim_args(tmp_path, "--plot", str(plot), "--json"))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    entry = doc["calibration"]
    assert doc["recovery_max_abs"] < 0.05, doc["recovery"]  # k1..k4 within 5 % of the hidden truth
    assert abs(doc["recovery"]["k5"]) < 1e-6 and abs(doc["recovery"]["kv_budget"]) < 1e-6
    assert entry["quality"]["holdout_mape"] < 0.05 and entry["ok"]
    assert entry["crossover_n"] == pytest.approx(HIDDEN.k2 / HIDDEN.k3, rel=0.1) and entry["regime"] == "both"
    assert entry["prefill_seconds_per_token"] == pytest.approx(2e-5, rel=0.05)
    assert entry["weight_load_seconds"] == pytest.approx(0.5 + 61e9 / 25e9, rel=1e-6)
    assert len(doc["samples"]) == entry["quality"]["samples"] and doc["out"] == str(tmp_path / "calibration.json")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    loaded = load_calibration(tmp_path / "calibration.json", "sim", "tp1")
    assert loaded == CostModel(**{k: entry["cost"][k] for k in ("k1", "k2", "k3", "k4", "k5", "kv_budget")})


def test_sim_calibration_table_output(tmp_path: Path) -> None:
    result = runner.invoke(cli(), _sim_args(tmp_path, "--n-values", "1,4,16,64,128", "--contexts", "512,4096",
                                            "--samples-per-point", "3", "--model-name", "tiny-sim"))
    assert result.exit_code == 0, result.output
    assert "cost model of tiny-sim / tp1" in result.stdout and "crossover n*" in result.stdout
    assert "wrote tiny-sim / tp1" in result.stdout


def test_poor_fit_refuses_or_warns(tmp_path: Path) -> None:
    out = tmp_path / "calibration.json"
    small = ("--n-values", "1,4,16,64,128", "--contexts", "512,4096", "--samples-per-point", "3", "--max-mape", "0.001")
    refused = runner.invoke(cli(), _sim_args(tmp_path, *small))
    assert refused.exit_code == POOR_FIT_EXIT
    assert "POOR FIT, REFUSED" in refused.output and not out.exists()
    warned = runner.invoke(cli(), _sim_args(tmp_path, *small, "--on-poor-fit", "warn"))
    assert warned.exit_code == 0 and "WARNING: POOR FIT" in warned.output
    entry = load_entry(out, "sim", "tp1", allow_poor=True)
    assert not entry.ok and entry.problems
    with pytest.raises(CalibrationError, match="poor fit"):
        load_calibration(out, "sim", "tp1")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "vllm"], "needs --model"),
        (["--engine", "vllm", "--model", "/no/such/model"], "does not exist"),
        (["--engine", "sim", "--noise", "-0.1"], "noise must be >= 0"),
        (["--engine", "sim", "--k1", "-1"], "k1 must be >= 0"),
        (["--engine", "tpu"], "sim or vllm"),
        (["--engine", "sim", "--n-values", "1,x"], "comma-separated integers"),
        (["--engine", "sim", "--n-values", "8"], ">= 2 running counts"),
        (["--engine", "sim", "--on-poor-fit", "ignore"], "refuse or warn"),
    ],
)
def test_bad_options_give_clear_errors(tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(cli(), ["calibrate", *args, "--out", str(tmp_path / "c.json")])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "c.json").exists()


# ---------------------------------------------------------------------------------------- file format


def test_calibration_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cal" / "calibration.json"
    report = fit_decode(synthetic(CostModel()))
    for parallelism, k5 in (("tp1", 1.0), ("tp2", 0.5)):
        entry = build_entry(model="qwen3-30b-a3b", parallelism=parallelism, engine="vllm", report=report, k5=k5,
                            kv_r2=1.0, kv_budget=1e6 if k5 == 0.5 else 2e6, prefill_seconds_per_token=3e-5)
        write_calibration(path, entry)
    file = read_calibration(path)
    assert set(file.entries["qwen3-30b-a3b"]) == {"tp1", "tp2"}
    tp2 = load_calibration(path, "qwen3-30b-a3b", "tp2")
    assert tp2.k5 == 0.5 and tp2.kv_budget == pytest.approx(1e6) and tp2.k1 == pytest.approx(CostModel().k1)
    assert load_entry(path, "qwen3-30b-a3b", "tp1").prefill_seconds_per_token == 3e-5
    with pytest.raises(CalibrationError, match="no calibration for model 'other'.*qwen3-30b-a3b"):
        load_calibration(path, "other")
    with pytest.raises(CalibrationError, match="parallelism 'tp8'.*tp1, tp2"):
        load_calibration(path, "qwen3-30b-a3b", "tp8")
    with pytest.raises(CalibrationError, match="does not exist"):
        load_calibration(tmp_path / "missing.json", "m")
    (tmp_path / "bad.json").write_text('{"format": "something-else"}')
    with pytest.raises(CalibrationError, match="not valid"):
        read_calibration(tmp_path / "bad.json")


def test_coordinator_and_up_take_the_cost_from_a_calibration_file(tmp_path: Path) -> None:
    """`calibration:` in the job / coordinator config (and `up --calibration`) sets the coordinator's
    cost. Validating a config only records the reference; the file is read where the coordinator
    starts (``resolved_cost``, called by its ``create_app``) and by ``up`` before anything starts."""
    from pydantic import ValidationError

    from staleflow.cli.up import job_config
    from staleflow.config import JobConfig
    from staleflow.coordinator.app import CoordinatorConfig, create_app

    path = tmp_path / "calibration.json"
    report = fit_decode(synthetic(HIDDEN))
    write_calibration(path, build_entry(model="tiny", parallelism="tp1", engine="vllm", report=report, k5=1.07,
                                        kv_r2=1.0, kv_budget=5e5))
    job = job_config(None, calibration={"file": str(path)})  # what `staleflow up --calibration FILE` builds
    assert job.calibration is not None and JobConfig.model_validate_json(job.model_dump_json()) == job
    assert job.coordinator.calibration == job.calibration  # the flat setting lives in the coordinator's section
    config = job.coordinator_config({"manager": "http://127.0.0.1:1", "ts": "http://127.0.0.1:2",
                                     "params": "http://127.0.0.1:3"}, [])  # as launch/plan.py does
    cost = resolved_cost(config.cost, config.calibration)
    assert cost.k5 == 1.07 and cost.kv_budget == 5e5
    assert cost.k3 == pytest.approx(HIDDEN.k3, rel=1e-6)
    assert CoordinatorConfig.model_validate_json(config.model_dump_json()) == config  # a dumped config
    with pytest.raises(ValidationError, match="not both"):
        CoordinatorConfig(ts_url="http://127.0.0.1:9", calibration=job.calibration, cost={"k1": 1e-7})
    missing = JobConfig(calibration={"file": str(tmp_path / "missing.json")})  # no file read in validation
    with pytest.raises(CalibrationError, match="does not exist"):
        create_app(missing.coordinator_config({"manager": "http://127.0.0.1:1", "ts": "http://127.0.0.1:2",
                                               "params": "http://127.0.0.1:3"}, []))
    with pytest.raises(typer.Exit):  # `up` reads it before anything starts
        job_config(None, calibration={"file": str(tmp_path / "missing.json")})
    with pytest.raises(CalibrationError, match="no calibration for model 'other'"):
        referenced_entry(JobConfig(calibration={"file": str(path), "model": "other"}).calibration)
    poor = build_entry(model="tiny", parallelism="tp2", engine="vllm", report=fit_decode(synthetic(HIDDEN, noise=0.05)),
                       k5=1.0, kv_r2=1.0, kv_budget=5e5, thresholds=Thresholds(max_mape=1e-3))
    write_calibration(path, poor)
    with pytest.raises(CalibrationError, match="tp1.*tp2.*calibration.parallelism"):  # two entries: name one
        referenced_entry(JobConfig(calibration={"file": str(path)}).calibration)
    with pytest.raises(CalibrationError, match="poor fit"):
        referenced_entry(JobConfig(calibration={"file": str(path), "parallelism": "tp2"}).calibration)
    assert referenced_entry(JobConfig(calibration={"file": str(path), "parallelism": "tp2", "allow_poor": True}).calibration)
    defaults = CoordinatorConfig(ts_url="http://127.0.0.1:9")
    assert resolved_cost(defaults.cost, defaults.calibration).k1 == CostModel().k1
