"""The job's logger setting: shorthand forms, and the --logger flag over a config file."""

from __future__ import annotations

from pathlib import Path

from staleflow.cli.up import job_config
from staleflow.config import JobConfig


def test_logger_shorthands() -> None:
    assert JobConfig.model_validate({"engine": "sim"}).logger.backends == ("console",)
    assert JobConfig.model_validate({"engine": "sim", "logger": "console, tensorboard"}).logger.backends == \
        ("console", "tensorboard")
    assert JobConfig.model_validate({"engine": "sim", "logger": ["wandb", "mlflow"]}).logger.backends == \
        ("wandb", "mlflow")
    assert JobConfig.model_validate({"engine": "sim", "logger": []}).logger.backends == ()


def test_the_flag_names_backends_and_keeps_the_files_other_logger_settings(tmp_path: Path) -> None:
    file = tmp_path / "job.yaml"
    file.write_text("engine: sim\nlogger:\n  backends: [console]\n  directory: /runs\n  project: p\n")
    config = job_config(file, logger="tensorboard,mlflow")
    assert config.logger.backends == ("tensorboard", "mlflow")
    assert config.logger.directory == Path("/runs") and config.logger.project == "p"
    assert job_config(file).logger.backends == ("console",)
