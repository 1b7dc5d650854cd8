"""The real job's defaults: the demo policy trains with its own recipe and task; a job with its
own model, and the simulated cluster, keep the general defaults; a user's settings win."""

from __future__ import annotations

from staleflow.config import DEMO_ALGORITHM, AlgorithmConfig, JobConfig


def test_the_demo_job_trains_with_the_demo_recipe_on_one_digit_addition() -> None:
    job = JobConfig()
    algorithm = job.trainer.algorithm
    assert {k: getattr(algorithm, k) for k in DEMO_ALGORITHM} == DEMO_ALGORITHM
    assert algorithm.lr_warmup_steps > 0 and algorithm.lr_decay != "constant"
    assert (job.task.digits, job.task.ops) == (1, "+")
    assert (job.max_tokens, job.ledger.eta, job.ledger.batch_size, job.ledger.group_size) == (24, 2, 16, 8)


def test_a_job_with_its_own_model_starts_from_the_general_defaults(tmp_path) -> None:
    job = JobConfig(model=tmp_path)
    assert job.trainer.algorithm == AlgorithmConfig()
    assert AlgorithmConfig().lr == 1e-6


def test_the_users_settings_override_the_recipe_and_keep_the_rest() -> None:
    job = JobConfig(trainer={"world_size": 3, "algorithm": {"lr": 5e-4}}, task={"ops": "+-"})
    assert job.trainer.world_size == 3 and job.trainer.algorithm.lr == 5e-4
    assert job.trainer.algorithm.lr_warmup_steps == DEMO_ALGORITHM["lr_warmup_steps"]
    assert (job.task.digits, job.task.ops) == (1, "+-")


def test_the_simulated_cluster_keeps_its_task() -> None:
    assert JobConfig(engine="sim").task.digits == 2


def test_the_written_job_file_reads_back_the_same() -> None:
    job = JobConfig()
    assert JobConfig.model_validate_json(job.model_dump_json()) == job
    own = JobConfig(trainer={"algorithm": {"lr": 1e-5, "lr_decay": "linear"}})
    assert JobConfig.model_validate_json(own.model_dump_json()) == own
