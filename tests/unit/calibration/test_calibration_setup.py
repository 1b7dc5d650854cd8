"""The vLLM settings `staleflow calibrate` derives from the model and the machine."""

from __future__ import annotations

import pytest

from staleflow.calibration.engine_setup import GIB, EngineSetupError, model_positions, vllm_settings

DEMO = {"max_position_embeddings": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 128}
DEMO_KV_BYTES = 2 * 4 * 2 * 32 * 4  # K and V x layers x KV heads x head dim x float32


def settings(config: dict = DEMO, **given: object):  # type: ignore[no-untyped-def]
    defaults = dict(max_model_len=None, kv_cache_gib=None, kv_bytes_per_token=DEMO_KV_BYTES, largest_n=128, cpu=True,
                    kv_space_set=False, free_bytes=15 * GIB)
    return vllm_settings(config, **{**defaults, **given})  # type: ignore[arg-type]


def test_max_model_len_is_the_models_positions_at_most() -> None:
    assert settings().max_model_len == 512
    assert settings({**DEMO, "max_position_embeddings": 32768}).max_model_len == 4096
    assert settings({}).max_model_len == 4096, "a config that does not say: the usual default"
    assert settings(max_model_len=256).max_model_len == 256
    with pytest.raises(EngineSetupError) as refused:
        settings(max_model_len=4096)
    assert "more than the model's 512 positions" in str(refused.value)
    assert refused.value.fix == "pass --max-model-len 512 or less, or leave it out"
    assert model_positions({"n_positions": 1024}) == 1024 and model_positions({"max_position_embeddings": "x"}) is None


def test_the_cpu_kv_cache_is_sized_for_the_grid_within_the_free_memory() -> None:
    # the demo model's grid (128 trajectories of 512 tokens) fills 128 MiB: 1 GiB is plenty
    demo = settings()
    assert demo.kv_cache_gib == 1 and any("KV cache 1 GiB" in note for note in demo.notes)
    # a model with 64 KiB per token would fill 128 x 4096 x 64 KiB / 0.85 = 38 GiB: half the free memory it is
    big = settings({}, kv_bytes_per_token=64 * 1024, free_bytes=15 * GIB)
    assert big.kv_cache_gib == 7 and any("left out" in note for note in big.notes)
    assert settings({}, kv_bytes_per_token=64 * 1024, free_bytes=200 * GIB).kv_cache_gib == 38
    with pytest.raises(EngineSetupError) as refused:
        settings(free_bytes=GIB)
    assert "only 1.0 GiB of memory is free" in str(refused.value) and "--kv-cache-gib" in refused.value.fix


def test_what_is_given_or_set_elsewhere_is_kept() -> None:
    assert settings(kv_cache_gib=3).kv_cache_gib == 3
    assert settings(cpu=False).kv_cache_gib is None, "a GPU build sizes its cache by memory utilisation"
    assert settings(kv_space_set=True).kv_cache_gib is None, "VLLM_CPU_KVCACHE_SPACE is the user's"
    with pytest.raises(EngineSetupError):
        settings(kv_cache_gib=0)


def test_a_machine_that_stays_busy_is_not_waited_for() -> None:
    from staleflow.calibration.profile import machine_stays_busy

    assert not machine_stays_busy([5.0] * 9, 0.3), "too few intervals to tell"
    assert machine_stays_busy([5.0] * 8 + [0.0] * 2, 0.3)
    assert not machine_stays_busy([0.1] * 8 + [5.0] * 2, 0.3), "quiet most of the time: disturbed points are retried"
    assert not machine_stays_busy([5.0] * 20, None), "no gating asked for"


def test_a_refused_fit_of_a_small_model_says_why_and_what_size_fits() -> None:
    from types import SimpleNamespace

    from staleflow.cli.calibrate import short_step_reason
    from staleflow.cost_model import CostModel

    def entry(engine: str, **cost: float) -> SimpleNamespace:
        return SimpleNamespace(engine=engine, cost=CostModel(**{"k1": 1e-7, "k2": 5e-5, "k3": 5e-5, **cost}))

    reason = short_step_reason(entry("vllm", k4=1.2e-3))  # type: ignore[arg-type]
    assert reason is not None and "1.2 ms with one trajectory running" in reason and "20M parameters" in reason
    assert short_step_reason(entry("vllm", k4=8e-3)) is None, "steps long enough: not the reason"  # type: ignore[arg-type]
    assert short_step_reason(entry("sim", k4=1e-3)) is None, "a virtual clock has no noise to blame"  # type: ignore[arg-type]


def test_the_command_refuses_more_positions_than_the_model_has_before_starting_vllm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from support import calibrate_cli
    from typer.testing import CliRunner

    (tmp_path / "config.json").write_text(json.dumps(DEMO))
    result = CliRunner().invoke(calibrate_cli(), ["calibrate", "--engine", "vllm", "--model", str(tmp_path),
                                                  "--max-model-len", "4096", "--no-write"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [line.strip() for line in result.output.splitlines()]
    assert lines[-2].startswith("error: --max-model-len 4096 is more than the model's 512 positions")
    assert lines[-1] == "fix: pass --max-model-len 512 or less, or leave it out"


def test_an_engine_that_does_not_start_is_one_message_with_the_fix() -> None:
    import asyncio

    from pydantic import BaseModel

    from staleflow.calibration.run import SIM_GRID, profile_and_fit, sim_probe
    from staleflow.cost_model import CostModel

    class ModelConfig(BaseModel):
        dtype: int

    probe, _ = sim_probe(dict(vars(CostModel())), 0.0, 0, 0.0, 64)

    async def refuses() -> None:
        ModelConfig(dtype="nonsense")  # type: ignore[arg-type]  # what vLLM raises for a bad --dtype

    probe.engine.start = refuses  # type: ignore[method-assign]
    with pytest.raises(EngineSetupError) as failed:
        asyncio.run(profile_and_fit(probe, SIM_GRID, lambda *_: None, model="m", parallelism="tp1", engine="sim"))
    assert str(failed.value) == ("the sim engine did not start: dtype: Input should be a valid integer, unable to "
                                 "parse string as an integer")
    assert failed.value.fix
