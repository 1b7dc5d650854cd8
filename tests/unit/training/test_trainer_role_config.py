"""The trainer role runs with its own section of the job, not the whole job."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from staleflow.config import JobConfig, TrainerRoleConfig
from staleflow.training.role import run_fsdp_trainer, run_trainer_role


def test_the_job_composes_the_trainer_roles_section(tmp_path: Path) -> None:
    job = JobConfig(engine="sim", steps=7, eta=2, state_dir=tmp_path, trainer={"seconds_per_step": 0.25}, speed=5)
    role = job.trainer_role_config()
    assert (role.backend, role.steps, role.eta, role.speed) == ("simulated", 7, 2, 5)
    assert role.trainer == job.trainer and role.model_dir is None
    assert role.step_log_path == tmp_path / "trainer" / "steps.jsonl"
    assert role.checkpoint_dir == tmp_path / "trainer" / "checkpoints"
    fsdp = JobConfig(engine="vllm", state_dir=tmp_path).trainer_role_config(tmp_path / "model")
    assert (fsdp.backend, fsdp.model_dir) == ("fsdp", tmp_path / "model")
    # what a follower rank is handed: the section round-trips, and it is a fraction of the job
    assert TrainerRoleConfig.model_validate_json(fsdp.model_dump_json()) == fsdp
    assert len(fsdp.model_dump_json()) < len(JobConfig(engine="vllm", state_dir=tmp_path).model_dump_json()) / 3


def test_an_fsdp_role_without_a_model_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    role = JobConfig(engine="vllm", state_dir=tmp_path).trainer_role_config()
    with pytest.raises(ValueError, match="needs model_dir"):
        run_fsdp_trainer(role, {}, None, threading.Event())  # type: ignore[arg-type]
    assert not role.checkpoint_dir.exists()


def test_a_stopped_role_returns_without_training(tmp_path: Path) -> None:
    role = JobConfig(engine="sim", state_dir=tmp_path).trainer_role_config()
    stop = threading.Event()
    stop.set()
    run_trainer_role(role, {"manager": "http://127.0.0.1:9", "ts": "http://127.0.0.1:9", "params": "http://127.0.0.1:9"},
                     stop)
    assert not role.step_log_path.exists() or role.step_log_path.read_text() == ""
