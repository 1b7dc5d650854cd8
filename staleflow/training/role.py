"""The trainer role: consume a Ready buffer, fetch its batch, train, push the next version, free.
It is no server but a client loop of the services (``staleflow.api``), run with its own section of
the job (``TrainerRoleConfig``): in a thread of the job, a process of its own or Ray actors.

Exactly-once across crashes of any role:
* consume names the buffer it means (``POST /v1/consume?version=v``), so a retry after a lost
  reply replays instead of consuming the next buffer;
* a batch is freed on the trajectory server only once a checkpoint covers it (for a backend
  without checkpoints of its own: once the version it produced is visible), so a restarted
  trainer retrains from its newest checkpoint with the batches it consumed after it, and a
  retrained step's record follows its first try's in ``steps.jsonl``;
* the parameter server refuses to overwrite a version, so a retrained step whose version was
  already pushed is not pushed again, and a checkpoint newer than the newest pushed version is
  pushed first: instances never wait for a version the trainer has moved past;
* the parameter server makes a version visible from memory before it persists it, so the
  trainer keeps what it pushed last (each rank of a sharded trainer its share, until persisted)
  and pushes it again before the next version when a crashed PS lost it.

Every step lands in ``steps.jsonl`` (fsynced) in the trainer's state directory: the job's live
view, its report and the fault harness read it, whether the trainer is a thread or a process.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from staleflow.api.base import RetriesStopped, ServiceError, retry_transient
from staleflow.api.manager import ManagerClient
from staleflow.api.params import StoreDescription
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config import TrainerRoleConfig
from staleflow.errors import ErrorCode
from staleflow.host import release_freed_heap
from staleflow.ports import free_port
from staleflow.training.base import (
    PushStopped,
    ShardedWeights,
    SharePusher,
    TrainerBackend,
    is_visible,
    pending_push,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class StepRecord:
    version: int
    finished_at: float  # seconds since the job started (wall clock)
    groups: int
    trajectories: int
    response_tokens: int
    mean_reward: float
    mean_length: float
    max_length: int
    staleness: dict[int, int]  # V_buf minus the oldest segment version (V_traj if none) -> count
    train_seconds: float  # simulated with the sim trainer, measured with a real one
    metrics: dict[str, float] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)  # std, min, max of the batch's rewards
    min_length: int = 0

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepRecord:
        fields = dict(data)
        fields["staleness"] = {int(k): v for k, v in fields["staleness"].items()}
        return cls(**fields)


def batch_record(version: int, batch: Mapping[str, Any], finished_at: float, metrics: Mapping[str, float]) -> StepRecord:
    trajs = batch["trajectories"]
    lengths = [len(t["tokens"]) for t in trajs]
    staleness: dict[int, int] = {}
    for t in trajs:  # from the oldest model that generated any of its tokens, not from V_traj alone
        oldest = min((segment["version"] for segment in t.get("segments", ())), default=t["v_traj"])
        staleness[version - oldest] = staleness.get(version - oldest, 0) + 1
    rewards = np.array([float(t["reward"]) for t in trajs])
    return StepRecord(
        version, finished_at, len(batch["groups"]), len(trajs), sum(lengths),
        float(rewards.mean()) if trajs else 0.0,
        float(np.mean(lengths)) if lengths else 0.0, max(lengths, default=0), staleness,
        float(metrics.get("train_seconds", 0.0)), {k: float(v) for k, v in metrics.items() if k != "train_seconds"},
        {"std": float(rewards.std()), "min": float(rewards.min()), "max": float(rewards.max())} if trajs else {},
        min(lengths, default=0))


class StepLog:
    """Append-only JSON lines, one per trained step, durable before the next step starts."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: StepRecord) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(record)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[StepRecord]:
        """One record per version (a retrained step replaces the record of its first try)."""
        if not self.path.exists():
            return []
        latest: dict[int, StepRecord] = {}
        for line in self.path.read_text().splitlines():
            try:
                record = StepRecord.from_json(json.loads(line))
            except (ValueError, TypeError, KeyError):
                continue  # a torn last line of a killed trainer
            latest[record.version] = record
        return [latest[v] for v in sorted(latest)]


class TrainerStopped(Exception):
    pass


class TrainerLoop:
    """Drives one backend through ``steps`` buffers; survives restarts of itself and of the
    manager, trajectory server and parameter server: transient errors are retried until ``stop``
    (or for ``outage_s`` seconds when given). The job's supervisor, not the trainer, decides when
    a component is beyond repair (a crash loop stops the job, and with it the trainer)."""

    def __init__(self, backend: TrainerBackend, *, steps: int, eta: int, urls: Mapping[str, str], step_log: StepLog,
                 stop: threading.Event, started: float | None = None, outage_s: float | None = None,
                 on_step: Callable[[StepRecord], None] | None = None, remote_push: str = "http"):
        self.backend = backend
        self.remote_push = remote_push
        self.steps = steps
        self.eta = eta
        self.urls = dict(urls)
        self.step_log = step_log
        self.stop = stop
        self.started = time.monotonic() if started is None else started
        self.outage_s = outage_s
        self.on_step = on_step
        self._last_pushed: tuple[int, Mapping[str, Any]] | None = None  # a whole state dict, held until the next push
        self._share_pusher: SharePusher | None = None  # a sharded trainer's: keeps this rank's last share

    # -- retries -----------------------------------------------------------------------

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return retry_transient(what, fn, self.stop, outage_s=self.outage_s, log=log)
        except RetriesStopped as exc:
            raise TrainerStopped(what) from exc

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except TrainerStopped:
            log.info("trainer stopped")  # the job is stopping: what is done is durable, the rest resumes

    def _run(self) -> None:
        from staleflow.transports.client import ParamsClient

        with ManagerClient(self.urls["manager"]) as manager, TrajectoryClient(self.urls["ts"], timeout=120) as ts, \
                ParamsClient(self.urls["params"], timeout=300, remote_push=self.remote_push) as params, \
                ThreadPoolExecutor(1, thread_name_prefix="push") as pusher:
            self.manager, self.ts, self.params = manager, ts, params
            trained = self._resume_point()
            # a backend without checkpoints of its own resumes from the newest visible version, so
            # its batches are covered (and freed) once the version they produced is visible
            own_checkpoints = self.backend.resume_version() is not None
            train_version = self._retry("read the ledger", manager.buffers).train_version
            freed_below = max(0, trained - self.eta - 2)
            freed_below = self._free(freed_below, trained)
            pushing: Future | None = None
            version = trained
            while version < self.steps and not self.stop.is_set():
                if version >= train_version:
                    if not self._consume(version):
                        break
                    train_version = version + 1
                batch = self._batch(version)
                metrics = self.backend.train(version, batch)
                # recorded before a checkpoint or a visible version covers the step: a crash in
                # between retrains it (a second record), never leaves it trained but unrecorded
                record = batch_record(version, batch, time.monotonic() - self.started, metrics)
                self.step_log.append(record)
                if self.on_step:
                    self.on_step(record)
                if pushing is not None:
                    pushing.result()  # one push at a time; it overlapped this step's training
                    if not own_checkpoints:
                        freed_below = self._free(freed_below, version)
                self._release_persisted_share()
                pushing = pusher.submit(self._push, version + 1, self.backend.weights(version + 1))
                if self.backend.checkpoint(version + 1) and own_checkpoints:
                    freed_below = self._free(freed_below, version + 1)
                version += 1
                # the batch (its reply's bytes, text and parsed objects) is transient and its size
                # varies: without this the process keeps its largest steps' worth of free heap
                del batch
                release_freed_heap()
            if pushing is not None:
                pushing.result()
                if not own_checkpoints:
                    self._free(freed_below, version)

    def _resume_point(self) -> int:
        latest = self._latest_pushed()
        trained = self.backend.resume_version()
        if trained is None:
            return latest if latest is not None else 0
        if trained > 0 and (latest is None or latest < trained):
            self._push(trained, self.backend.weights(trained))  # the checkpoint outran the last push
        return trained

    def _latest_pushed(self) -> int | None:
        def latest() -> int | None:
            try:
                return self.params.latest().version
            except ServiceError as exc:
                if exc.code is ErrorCode.UNKNOWN_VERSION:  # nothing pushed yet
                    return None
                raise

        return self._retry("read the parameter server", latest)

    def _consume(self, version: int) -> bool:
        """Consume buffer ``version`` once it is Ready; False if the job is stopping."""
        while not self.stop.is_set():
            try:
                self._retry(f"consume buffer {version}", lambda: self.manager.consume(version))
                return True
            except TrainerStopped:
                return False
            except ServiceError as exc:
                if exc.code is not ErrorCode.NOT_READY:
                    raise
            self.stop.wait(0.02)  # poll pacing: the buffer is not Ready yet
        return False

    def _batch(self, version: int) -> dict:
        def fetch() -> dict:
            try:  # plain data, as the backends take it: no model in between
                return self.ts.json(TrajectoryClient.batch, version)
            except ServiceError as exc:
                if exc.transient:
                    raise
                raise RuntimeError(f"batch {version} cannot be fetched ({exc}); "
                                   "it was freed before a checkpoint covered it") from exc

        return self._retry(f"fetch batch {version}", fetch)

    def _push(self, version: int, tensors: Mapping[str, Any] | ShardedWeights) -> None:
        if isinstance(tensors, ShardedWeights):
            self._push_share(version, tensors)
        else:
            self._push_whole(version, tensors)

    def _push_share(self, version: int, share: ShardedWeights) -> None:
        """This rank's share of a sharded version (the other ranks push theirs at once), seen
        through to visible; a kept share of the previous version is pushed again first if the PS
        lost it (``SharePusher``)."""
        if self._share_pusher is None:
            self._share_pusher = SharePusher(share.part, stop=self.stop, outage_s=self.outage_s)
        try:
            self._share_pusher.push(self.params, version, share)
        except PushStopped as exc:
            raise TrainerStopped(f"push version {version}") from exc

    def _release_persisted_share(self) -> None:
        """Before the next snapshot: the kept share goes if the PS persisted its version, so a
        rank holds one extra share, not two, when persistence keeps up."""
        if self._share_pusher is not None:
            self._share_pusher.release_if_persisted(self.params)

    def _push_whole(self, version: int, tensors: Mapping[str, Any]) -> None:
        def push() -> None:
            state = self.params.versions()
            if is_visible(state, version):
                return  # pushed before a restart: versions are immutable
            self._repush_lost(state)
            pending = pending_push(state, version)
            if pending is not None:  # left unfinished by a killed trainer (a part that joins again starts over)
                self.params.abort_push(version, pending.push_id)
            self.params.push(version, tensors)

        self._retry(f"push version {version}", push)
        self._last_pushed = (version, tensors)

    def _repush_lost(self, state: StoreDescription) -> None:
        """The PS serves versions from memory first and persists them after: one that was visible
        but not yet on disk when the PS crashed is gone. Push it again while its tensors are held."""
        if self._last_pushed is None:
            return
        version, tensors = self._last_pushed
        if is_visible(state, version):
            return
        log.warning("the parameter server lost version %d (visible, not yet persisted): pushing it again", version)
        self.params.push(version, tensors)

    def _free(self, freed_below: int, covered: int) -> int:
        def free(version: int) -> None:
            try:
                self.ts.free_batch(version)
            except ServiceError as exc:
                if exc.transient:  # the TS could not reach the manager: retried, not lost
                    raise
                log.warning("freeing batch %d: %s", version, exc)

        for v in range(freed_below, covered):
            self._retry(f"free batch {v}", lambda v=v: free(v))
        return max(freed_below, covered)


def run_trainer_role(role: TrainerRoleConfig, urls: Mapping[str, str], stop: threading.Event,
                     started: float | None = None) -> None:
    """The trainer role until ``role.steps`` buffers are trained (or ``stop``): the simulated
    backend in this thread, or an FSDP2 trainer whose rank 0 this process is."""
    step_log = StepLog(role.step_log_path)
    if role.backend == "simulated":
        from staleflow.training.simulated import SimulatedBackend

        t = role.trainer
        backend = SimulatedBackend(t.seconds_per_step, t.seconds_per_token, t.push_bytes, role.speed, stop)
        TrainerLoop(backend, steps=role.steps, eta=role.eta, urls=urls, step_log=step_log, stop=stop, started=started,
                    remote_push=t.remote_push).run()
        return
    run_fsdp_trainer(role, urls, step_log, stop, started)


def _model_dir(role: TrainerRoleConfig) -> Path:
    if role.model_dir is None:
        raise ValueError("an FSDP2 trainer role needs model_dir: the model to train")
    return role.model_dir


def run_fsdp_trainer(role: TrainerRoleConfig, urls: Mapping[str, str], step_log: StepLog, stop: threading.Event,
                     started: float | None = None) -> None:
    """The trainer role on the FSDP2 backend: this process is rank 0; ranks 1..world-1 are spawned
    (with the role's section, not the whole job) and die with it."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from staleflow.training.fsdp import (
        FsdpBackend,
        RankDriver,
        check_gpus_for_ranks,
        init_process_group,
        resolve_settings,
        run_follower,
    )

    world = role.trainer.world_size
    check_gpus_for_ranks(world)  # all ranks on this node: refused before any starts
    resolve_settings(role.trainer, torch.device("cuda" if torch.cuda.is_available() else "cpu"))  # likewise
    model_dir = _model_dir(role)
    port = free_port()
    role.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    followers = [context.Process(target=run_follower, args=(r, world, port, role.model_dump_json()),
                                 daemon=True, name=f"rank-{r}") for r in range(1, world)]
    for p in followers:
        p.start()
    init_process_group(0, world, port)
    driver = RankDriver(FsdpBackend(role.trainer, model_dir, role.checkpoint_dir, 0, world, role.steps),
                        params_url=urls["params"])
    from staleflow.training.metering import MeteredBackend

    try:
        TrainerLoop(MeteredBackend.around(driver), steps=role.steps, eta=role.eta, urls=urls, step_log=step_log, stop=stop,
                    started=started, remote_push=role.trainer.remote_push).run()
    finally:
        driver.close()
        for p in followers:
            p.join(30)
        dist.destroy_process_group()


def run_fsdp_rank(role: TrainerRoleConfig, urls: Mapping[str, str], stop: threading.Event,
                  started: float | None = None) -> None:
    """One rank of an FSDP2 trainer whose ranks a launcher started on their own (one process each,
    maybe on other machines) with the rendezvous in the environment (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``): rank 0 runs the trainer role, the others follow it."""
    import torch.distributed as dist

    from staleflow.training.fsdp import (
        RENDEZVOUS_ENV,
        FsdpBackend,
        RankDriver,
        follow,
        init_process_group,
        rendezvous_from_env,
    )

    rendezvous = rendezvous_from_env()
    if rendezvous is None:
        raise RuntimeError(f"run_fsdp_rank needs {', '.join(RENDEZVOUS_ENV)} in the environment")
    master_addr, port, rank, world = rendezvous
    model_dir = _model_dir(role)
    role.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    init_process_group(rank, world, port, master_addr)
    try:
        local = FsdpBackend(role.trainer, model_dir, role.checkpoint_dir, rank, world, role.steps)
        if rank > 0:
            follow(local)
            return
        driver = RankDriver(local, params_url=urls["params"])
        from staleflow.training.metering import MeteredBackend

        try:
            TrainerLoop(MeteredBackend.around(driver), steps=role.steps, eta=role.eta, urls=urls,
                        step_log=StepLog(role.step_log_path), stop=stop, started=started,
                        remote_push=role.trainer.remote_push).run()
        finally:
            driver.close()
    finally:
        dist.destroy_process_group()
