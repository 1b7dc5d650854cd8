"""The FSDP2 trainer backend: two gloo ranks train exactly what one process trains, push their
own shards to the parameter server at once (no gather), and resume from their checkpoint; through a
parameter-server crash, every rank pushes again the version the PS lost before persisting it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import ParamsProcess, free_port, save_tiny_qwen2

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")
transformers = pytest.importorskip("transformers", reason="the trainer needs transformers")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from staleflow.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from staleflow.servers.http import serve_in_thread  # noqa: E402
from staleflow.servers.params import ParamsConfig, create_app  # noqa: E402
from staleflow.training.fsdp import FsdpBackend, RankDriver, follow, init_process_group  # noqa: E402
from staleflow.training.role import StepLog, TrainerLoop  # noqa: E402
from staleflow.transports.client import ParamsClient  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]


def _config(world: int) -> TrainerConfig:
    return TrainerConfig(world_size=world, checkpoint_every=1, algorithm=AlgorithmConfig(lr=1e-2, micro_batch=2))


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(5):  # odd: rank 1 gets fewer trajectories and pads with an empty micro-batch
        n = 3 + i
        trajs.append({"group_id": f"g{i % 2}", "prompt_ids": torch.randint(3, 60, (4,), generator=g).tolist(),
                      "tokens": torch.randint(3, 60, (n,), generator=g).tolist(),
                      "logprobs": (-torch.rand(n, generator=g) * 3).tolist(), "reward": float(i % 3 == 0),
                      "v_traj": 0})
    return {"version": 0, "groups": ["g0", "g1"], "trajectories": trajs}


def _rank(rank: int, world: int, port: int, model_dir: str, checkpoints: str, out: str, params_url: str) -> None:
    init_process_group(rank, world, port)
    try:
        backend = FsdpBackend(_config(world), Path(model_dir), Path(checkpoints), rank, world, final_version=1)
        metrics = backend.train(0, _batch())
        share = backend.weights(1)
        backend.checkpoint(1)
        with ParamsClient(params_url) as client:  # every rank pushes its own shards, at once
            reply = share.push(client, TWO_RANKS, wait_s=120)
        assert reply["visible"]
        if rank == 0:
            torch.save({"metrics": metrics, "share_bytes": share.nbytes}, out)
    finally:
        dist.destroy_process_group()


ONE_RANK, TWO_RANKS, RESUMED = 1, 2, 3  # the versions each trainer pushes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def _train_here(model_dir: Path, checkpoints: Path, ps: ParamsClient) -> dict:
    """One rank in this process: the reference the two ranks must match."""
    init_process_group(0, 1, free_port())
    try:
        backend = FsdpBackend(_config(1), model_dir, checkpoints, 0, 1, final_version=1)
        metrics = backend.train(0, _batch())
        assert backend.weights(1).push(ps, ONE_RANK)["visible"]
        return {"metrics": metrics, "weights": ps.pull(ONE_RANK, as_torch=True)}
    finally:
        dist.destroy_process_group()


@pytest.fixture
def ps(tmp_path: Path) -> Iterator[ParamsClient]:
    config = ParamsConfig(state_dir=tmp_path / "params", port=0, fsync=False, keep=5)
    with serve_in_thread(create_app(config)) as server, ParamsClient(server.url) as client:
        yield client


def test_two_ranks_match_one_and_resume_from_the_checkpoint(model_dir: Path, tmp_path: Path, ps: ParamsClient) -> None:
    one = _train_here(model_dir, tmp_path / "ckpt-1", ps)
    out, checkpoints = tmp_path / "out-2.pt", tmp_path / "ckpt-2"
    checkpoints.mkdir()
    mp.start_processes(_rank, args=(2, free_port(), str(model_dir), str(checkpoints), str(out), ps.url), nprocs=2,
                       start_method="spawn")
    two = {**torch.load(out), "weights": ps.pull(TWO_RANKS, as_torch=True)}
    one_bytes = ps.versions().versions[0].total_bytes
    assert two["share_bytes"] < one_bytes  # rank 0 held its shards (and the small replicated tensors), not the model
    initial = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(two["weights"]) == set(initial) - {"lm_head.weight"}  # tied head left to the engine
    moved = max((two["weights"][k] - initial[k]).abs().max().item() for k in two["weights"])
    assert moved > 1e-4  # the step changed the policy
    for name, tensor in one["weights"].items():
        assert torch.allclose(tensor, two["weights"][name], atol=2e-5), name
    for key in ("loss", "importance_weight_mean", "negative_logp"):
        assert one["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-4, abs=1e-6), key
    assert two["metrics"]["importance_weight_mean"] > 0 and two["metrics"]["grad_norm"] > 0

    init_process_group(0, 1, free_port())  # a fresh single-rank trainer resumes from the two-rank checkpoint
    try:
        resumed = FsdpBackend(_config(1), model_dir, checkpoints, 0, 1, final_version=2)
        assert resumed.resume_version() == 1
        assert resumed.weights(1).push(ps, RESUMED)["visible"]
        state = ps.pull(RESUMED, as_torch=True)
        for name, tensor in two["weights"].items():
            assert torch.allclose(tensor, state[name], atol=1e-6), name
    finally:
        dist.destroy_process_group()


def _trainer_rank(rank: int, world: int, port: int, model_dir: str, state: str, params_url: str,
                  pushed: Any, restarted: Any) -> None:
    """Rank 0 runs the trainer role's push (``TrainerLoop._push``) with the ``RankDriver``; the
    other ranks follow it and push their shares in the background, as in a job."""
    init_process_group(rank, world, port)
    try:
        local = FsdpBackend(_config(world), Path(model_dir), Path(state) / "checkpoints", rank, world, final_version=2)
        if rank > 0:
            follow(local)
            return
        driver = RankDriver(local, params_url)
        loop = TrainerLoop(driver, steps=2, eta=1, urls={"params": params_url}, step_log=StepLog(Path(state) / "steps.jsonl"),
                           stop=threading.Event())
        with ParamsClient(params_url) as client:
            loop.params = client
            try:
                for version in (1, 2):
                    driver.train(version - 1, _batch())
                    loop._push(version, driver.weights(version))
                    if version == 1:
                        pushed.set()
                        restarted.wait()  # the test kills the parameter server and starts it again
            finally:
                driver.close()
    finally:
        dist.destroy_process_group()


def test_every_rank_pushes_again_a_version_the_ps_lost_before_persisting_it(model_dir: Path, tmp_path: Path) -> None:
    """Version 1 is visible in the PS's memory only when the PS is SIGKILLed: before version 2,
    both ranks push their shares of version 1 again, then version 2."""
    server = ParamsProcess(tmp_path / "params", "--keep", "3")
    server.start(persist=False)  # a PS that never persists: a visible version lives in its memory only
    context = mp.get_context("spawn")
    pushed, restarted = context.Event(), context.Event()
    (tmp_path / "checkpoints").mkdir()
    port = free_port()
    ranks = [context.Process(target=_trainer_rank, args=(r, 2, port, str(model_dir), str(tmp_path), server.url, pushed, restarted))
             for r in range(2)]
    try:
        for process in ranks:
            process.start()
        while not pushed.wait(1):  # poll pacing: a rank that dies fails the test instead of hanging it
            assert all(p.is_alive() for p in ranks), [p.exitcode for p in ranks]
        with ParamsClient(server.url) as client:
            first = {name: t.tobytes() for name, t in client.pull(1).items()}
        server.kill()
        server.start(persist=False)
        restarted.set()
        for process in ranks:
            process.join()
            assert process.exitcode == 0
        with ParamsClient(server.url) as client:
            assert [v.version for v in client.versions().versions] == [1, 2]
            assert {name: t.tobytes() for name, t in client.pull(1).items()} == first  # the same bytes again
            second = {name: t.tobytes() for name, t in client.pull(2).items()}
            assert set(second) == set(first) and second != first  # the next step's weights, complete
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
        server.stop()
