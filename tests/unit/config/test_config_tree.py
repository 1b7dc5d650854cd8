"""The config tree: a job composes each component's config from its section, the engine presets
are data a job's own values override, flat settings land in their sections, and every default is
declared once (the services and the CLI read it from the models)."""

from __future__ import annotations

import inspect
import json
import typing
from pathlib import Path

import pytest
import typer

from staleflow.cli.main import app
from staleflow.config import (
    ENGINE_PRESETS,
    CoordinatorConfig,
    CostConfig,
    JobConfig,
    LedgerConfig,
    ManagerConfig,
    ParamsConfig,
    RewardConfig,
    SimConfig,
    default_of,
)
from staleflow.config.compose import JobSections
from staleflow.config.strategy import MigrationMode, RoutingMode, StrategyConfig, SyncMode
from staleflow.coordinator.service import Coordinator
from staleflow.cost_model import CostModel

ROOT = Path(__file__).resolve().parents[3]
URLS = {name: f"http://127.0.0.1:{9000 + i}" for i, name in
        enumerate(["manager", "params", "reward", "ts", "inst-0", "inst-1", "coordinator"])}


def test_each_engine_preset_sets_its_component_sections() -> None:
    sim, vllm = JobConfig(engine="sim"), JobConfig(engine="vllm")
    assert (sim.coordinator.failure_timeout, sim.coordinator.command_timeout, sim.coordinator.stall_timeout) == \
        (5.0, 30.0, 60.0)
    assert (vllm.coordinator.failure_timeout, vllm.coordinator.command_timeout, vllm.coordinator.stall_timeout) == \
        (60.0, 120.0, 120.0)
    for job in (sim, vllm):
        assert (job.params.keep, job.params.fsync) == (3, False)
        preset = ENGINE_PRESETS[job.engine]
        assert (job.instances, job.max_tokens, job.steps) == (preset["instances"], preset["max_tokens"], preset["steps"])


def test_a_jobs_own_section_values_win_and_a_partial_section_keeps_the_preset() -> None:
    job = JobConfig(engine="vllm", coordinator={"stall_timeout": 30}, params={"keep": 5})
    assert job.coordinator.stall_timeout == 30 and job.coordinator.command_timeout == 120.0
    assert job.params.keep == 5 and job.params.fsync is False
    assert JobConfig(engine="sim", trajectories={"sampling": {"max_tokens": 64}}).max_tokens == 64


def test_flat_settings_go_into_their_sections_and_win_over_them() -> None:
    job = JobConfig(engine="sim", routing="vanilla", sync="greedy", eta=1, trainer_ranks=3, cycle_period=0.2,
                    coordinator={"strategy": {"routing": "throughput", "mu": 0.5}}, ledger={"batch_size": 4})
    strategy = job.coordinator.strategy
    assert (strategy.routing, strategy.sync, strategy.mu) == (RoutingMode.VANILLA, SyncMode.GREEDY, 0.5)
    assert (job.routing, job.sync, job.migration, job.mu) == (RoutingMode.VANILLA, SyncMode.GREEDY,
                                                              MigrationMode.THROUGHPUT, 0.5)
    assert (job.ledger.eta, job.ledger.batch_size, job.ledger.group_size) == (1, 4, 8)  # partial ledger: job defaults
    assert job.trainer.world_size == 3 and job.cycle_period == job.coordinator.cycle_period == 0.2
    # the written job file is nested and reads back the same
    dumped = json.loads(job.model_dump_json())
    assert "routing" not in dumped and dumped["coordinator"]["strategy"]["routing"] == "vanilla"
    assert JobConfig.model_validate_json(job.model_dump_json()) == job


@pytest.mark.parametrize("path", ["deploy/job.json"])
def test_existing_job_files_still_load(path: str) -> None:
    job = JobConfig.model_validate(json.loads((ROOT / path).read_text()))
    assert job.engine == "sim" and job.max_tokens == 2048 and job.coordinator.failure_timeout == 5.0


def test_the_job_composes_every_component_config() -> None:
    job = JobConfig(engine="sim", state_dir=Path("/tmp/run"), instances=2, seed=7, routing="vanilla",
                    coordinator={"command_timeout": 9}, params={"keep": 4}, reward_server={"workers": 3},
                    trajectories={"filter_zero_variance": True}, instance={"outbox_limit": 50},
                    manager={"synchronous": "NORMAL"})
    manager = job.manager_config()
    assert manager.ledger == job.ledger and manager.synchronous == "NORMAL" and manager.state_dir == job.state_dir
    params = job.params_config()
    assert params.keep == 4 and params.fsync is False and params.state_dir == Path("/tmp/run/params")
    assert job.reward_config().workers == 3
    ts = job.trajectories_config(URLS, tokenizer=None)
    assert ts.reward == "sim" and ts.manager_url == URLS["manager"] and ts.filter_zero_variance
    assert ts.sampling.max_tokens == job.max_tokens and ts.seed == 7 and ts.task == job.task
    inst = job.instance_config("inst-1", URLS, model=None)
    assert inst.engine == "sim" and inst.sim.seed == 8 and inst.sim.workload_seed == 7 and inst.outbox_limit == 50
    assert inst.sim.kv_budget == job.kv_budget and inst.completion_callback_url == f"{URLS['ts']}/v1/completed"
    coordinator = job.coordinator_config(URLS, ["inst-0", "inst-1"])
    assert coordinator.strategy == job.coordinator.strategy and coordinator.strategy.routing is RoutingMode.VANILLA
    assert coordinator.command_timeout == 9 and coordinator.failure_timeout == 5.0
    assert [i.url for i in coordinator.instances] == [URLS["inst-0"], URLS["inst-1"]]
    vllm = JobConfig(engine="vllm", seed=3).instance_config("inst-1", URLS, model=Path("/models/tiny"))
    assert vllm.vllm is not None and vllm.vllm.model == "/models/tiny" and vllm.vllm.seed == 4


def test_the_trajectory_server_learns_the_models_vocabulary(tmp_path: Path) -> None:
    """The sim engine draws ids from its workload's vocabulary; a real engine's model says its own
    in config.json (a multimodal one in its text_config); a model that does not say leaves the
    storage type's bound only."""
    assert JobConfig(engine="sim", workload="ci-tiny").trajectories_config(URLS, tokenizer=None).vocab_size == 512
    assert JobConfig(engine="sim", workload="demo").trajectories_config(URLS, tokenizer=None).vocab_size == 151_936
    vllm = JobConfig(engine="vllm")
    for name, config, vocab in [("plain", {"vocab_size": 1000}, 1000),
                                ("multimodal", {"text_config": {"vocab_size": 2048}}, 2048),
                                ("silent", {"hidden_size": 8}, None), ("odd", {"vocab_size": "many"}, None)]:
        model = tmp_path / name
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        assert vllm.trajectories_config(URLS, tokenizer=model).vocab_size == vocab, name
    assert vllm.trajectories_config(URLS, tokenizer=tmp_path / "absent").vocab_size is None


def test_the_job_has_every_section_the_composition_reads() -> None:
    """``compose`` reads a job through ``JobSections`` (it cannot import ``JobConfig``, which uses it):
    every field that protocol names is one of the job's, with the same type."""
    job_hints = typing.get_type_hints(JobConfig)
    read = typing.get_type_hints(JobSections)
    assert read, "JobSections names the job fields the composition reads"
    for name, hint in read.items():
        assert name in JobConfig.model_fields, f"JobSections.{name} is no JobConfig field"
        assert hint == job_hints[name], f"JobSections.{name} is {hint}, JobConfig.{name} is {job_hints[name]}"
    assert callable(JobConfig.database_url)


def test_the_coordinator_contains_the_strategy_instead_of_restating_it() -> None:
    strategy_fields = set(StrategyConfig.__dataclass_fields__)
    assert not strategy_fields & set(CoordinatorConfig.model_fields)
    assert not strategy_fields & set(JobConfig.model_fields)
    flat = CoordinatorConfig(ts_url="http://127.0.0.1:9", routing="vanilla", max_in_flight=8)
    assert flat.strategy == StrategyConfig(routing=RoutingMode.VANILLA, max_in_flight=8)


def test_timeouts_are_declared_once() -> None:
    """The coordinator service has no defaults of its own for what its config declares."""
    signature = inspect.signature(Coordinator)
    for name in ("cycle_period", "command_timeout", "failure_timeout", "stall_timeout"):
        assert signature.parameters[name].default is inspect.Parameter.empty, name
        assert name in CoordinatorConfig.model_fields


def test_one_cost_coefficient_model() -> None:
    from staleflow.config.cost import CostCoefficients

    assert CostConfig is CostCoefficients and issubclass(SimConfig, CostCoefficients)
    assert CostCoefficients().cost_model() == CostModel()
    assert SimConfig(k1=1e-7).cost_model() == CostModel(k1=1e-7)


def _options(*path: str) -> dict[str, object]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # a group's subcommands
    return {p.name: p.default for p in command.params}


def test_cli_defaults_come_from_the_models() -> None:
    manager = _options("serve", "manager")
    for name in ("eta", "batch_size", "group_size", "batch_redundancy", "group_redundancy"):
        assert manager[name] == default_of(LedgerConfig, name), name
    for name in ("host", "port", "synchronous", "state_dir"):
        assert manager[name] == default_of(ManagerConfig, name), name
    params = _options("serve", "params")
    for name in ("keep", "host", "port", "shm_dir", "fsync", "lease_ttl_s", "state_dir"):
        assert params[name] == default_of(ParamsConfig, name), name
    assert params["chunk_mb"] * (1 << 20) == default_of(ParamsConfig, "chunk_bytes")
    assert params["transports"] == ",".join(default_of(ParamsConfig, "transports"))
    reward = _options("serve", "reward")
    assert (reward["default"], reward["workers"], reward["timeout_s"], reward["port"]) == tuple(
        default_of(RewardConfig, n) for n in ("default_verifier", "workers", "timeout_s", "port"))


def test_repack_on_vllm_with_its_stats_off_is_refused_with_the_fix() -> None:
    off = {"dtype": "float32", "engine_args": {"disable_log_stats": True}}
    with pytest.raises(ValueError, match="drop vllm_args.engine_args.disable_log_stats"):
        JobConfig(engine="vllm", vllm_args=off, coordinator={"migration": "repack"})
    assert JobConfig(engine="vllm", vllm_args=off, coordinator={"migration": "starved"})
    assert JobConfig(engine="vllm", coordinator={"migration": "starved+repack"}).coordinator.strategy.migration.repacks
