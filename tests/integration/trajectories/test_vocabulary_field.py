"""A field declared once, in the trajectory vocabulary (``staleflow.api.trajectory.ResponseFields``),
reaches the trainer's batch across a whole job on loopback: manager, trajectory server, parameter
server, two sim instances, the coordinator and the trainer's loop.

A fresh interpreter adds the field to the vocabulary's source before anything imports it, as an
edit of that one class would, then runs the job. The field's default is computed where a model is
first built without it: the trajectory id and the response length at that hop. The trajectory
server builds it at a trajectory's first checkout, with no tokens yet, so every hop that carries
the field (the coordinator's Route, the instance's partials and completions, the server's store
and its batch) keeps ``<traj_id>@0``; a hop that rebuilt the trajectory instead of carrying it
would show the tokens it held there. Before the job, one trajectory takes the partial's path on
its own (checked out, routed to an instance on a virtual clock, interrupted holding tokens, handed
back), the way the coordinator's Interrupt does, but without depending on timing; the job then
routes it again from what the trajectory server stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ETA, BATCH, GROUP, STEPS, MAX_TOKENS = 1, 2, 2, 3, 64

FIELD = """
    lineage: str = Field(default_factory=lambda data: f"{data['traj_id']}@{len(data['tokens'])}",
                         description="test-only: the trajectory and its response length where this was first set")
"""


def declare_field() -> None:
    """Add ``FIELD`` to ``ResponseFields`` in this process, before the vocabulary is imported."""
    import importlib.util

    import staleflow.api  # the package alone: it does not import the vocabulary

    name = "staleflow.api.trajectory"
    assert name not in sys.modules, "the vocabulary was imported before the field was added"
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    start = source.index("class ResponseFields(")
    end = source.index("\n\n\nclass ", start)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source[:end] + FIELD.rstrip() + source[end:], spec.origin, "exec"), module.__dict__)
    staleflow.api.trajectory = module  # type: ignore[attr-defined]


def hand_back_a_partial(ts_url: str, instance_url: str) -> dict:
    """One trajectory checked out, routed, interrupted once it holds tokens, and handed back."""
    from staleflow.api.instance import InstanceClient, InterruptCommand, RouteCommand
    from staleflow.api.trajectories import Assignment, TrajectoryClient

    with TrajectoryClient(ts_url) as ts, InstanceClient(instance_url) as instance:
        traj_id = ts.pending().trajectories[0].traj_id
        routed = ts.checkout(instance_id="probe", assignments=[Assignment(traj_id=traj_id, v_traj=0)]).trajectories
        instance.command(RouteCommand(command_id="probe-route", trajectories=routed))
        for _ in range(1000):  # virtual time, a little at a time, until the trajectory holds tokens
            instance.advance(by=0.005)
            if instance.progress().held.get(traj_id):
                break
        reply = instance.command(InterruptCommand(command_id="probe-interrupt", traj_ids=[traj_id]))
        (partial,) = reply.partials  # type: ignore[union-attr]
        ts.give_back(instance_id="probe", partials=reply.partials)  # type: ignore[union-attr]
        return {"traj_id": traj_id, "tokens": len(partial.tokens), "lineage": partial.lineage}  # type: ignore[attr-defined]


def run_job(state: Path) -> dict:
    """The whole job with the field declared; what the trainer trained on and what the store keeps."""
    declare_field()
    import threading
    from contextlib import ExitStack
    from typing import Any

    from staleflow.api.trajectories import TrajectoryClient
    from staleflow.config import LedgerConfig
    from staleflow.config.strategy import StrategyConfig, SyncMode
    from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
    from staleflow.coordinator.app import create_app as coordinator_app
    from staleflow.servers.http import serve_in_thread
    from staleflow.servers.instance import InstanceConfig, SimConfig
    from staleflow.servers.instance import create_app as instance_app
    from staleflow.servers.manager import ManagerConfig
    from staleflow.servers.manager import create_app as manager_app
    from staleflow.servers.params import ParamsConfig
    from staleflow.servers.params import create_app as params_app
    from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
    from staleflow.servers.trajectories import create_app as ts_app
    from staleflow.servers.trajectories.store import TrajectoryStore
    from staleflow.training.role import StepLog, TrainerLoop
    from staleflow.training.simulated import SimulatedBackend

    batches: list[list[dict[str, Any]]] = []

    class Recording(SimulatedBackend):
        def train(self, version: int, batch: Any) -> dict[str, float]:
            batches.append([{"traj_id": t["traj_id"], "lineage": t.get("lineage"), "tokens": len(t["tokens"])}
                            for t in batch["trajectories"]])
            return super().train(version, batch)

    ledger = LedgerConfig(eta=ETA, batch_size=BATCH, group_size=GROUP)
    ts_config = TrajectoryServerConfig(ledger=ledger, manager_url="http://127.0.0.1:1", state_dir=state, reward="sim",
                                       sampling=SamplingConfig(max_tokens=MAX_TOKENS))
    with ExitStack() as stack:
        manager_url = stack.enter_context(serve_in_thread(manager_app(ManagerConfig(
            ledger=ledger, state_dir=state / "manager", port=0)))).url
        ts_config = ts_config.model_copy(update={"manager_url": manager_url})
        ts_url = stack.enter_context(serve_in_thread(ts_app(ts_config))).url
        params_url = stack.enter_context(serve_in_thread(params_app(ParamsConfig(
            state_dir=state / "params", port=0, fsync=False)))).url
        with serve_in_thread(instance_app(InstanceConfig(instance_id="probe", sim=SimConfig(
                workload="ci-tiny", clock="virtual")))) as probe:
            handed_back = hand_back_a_partial(ts_url, probe.url)
        instances = {name: stack.enter_context(serve_in_thread(instance_app(InstanceConfig(
            instance_id=name, completion_callback_url=TrajectoryClient.completed.url(ts_url),
            sim=SimConfig(workload="ci-tiny", clock="real", speed=20.0))))).url for name in ("a", "b")}
        stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager_url, ts_url=ts_url, cycle_period=0.02, params_url=params_url,
            strategy=StrategyConfig(sync=SyncMode.GREEDY),  # a new version interrupts what runs: partials go back
            instances=[InstanceEndpoint(instance_id=n, url=url) for n, url in instances.items()]))))
        stop = threading.Event()
        watchdog = threading.Timer(240.0, stop.set)  # a stalled job ends short of its steps, and the test says so
        watchdog.start()
        TrainerLoop(Recording(0.0, 0.0, 1024, 1.0, stop), steps=STEPS, eta=ETA, outage_s=120,
                    urls={"manager": manager_url, "ts": ts_url, "params": params_url},
                    step_log=StepLog(state / "steps.jsonl"), stop=stop).run()
        watchdog.cancel()
    store = TrajectoryStore.open(ts_config.database_url())  # read back from the database
    try:
        stored = {}
        for t in (t for batch in batches for t in batch):
            found = store.trajectory(t["traj_id"])
            stored[t["traj_id"]] = None if found is None else found[0].carried
    finally:
        store.close()
    return {"batches": batches, "handed_back": handed_back, "stored": stored}


def test_a_field_declared_once_in_the_vocabulary_reaches_the_trainers_batch(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    trained = [t for batch in outcome["batches"] for t in batch]
    assert len(outcome["batches"]) == STEPS and len(trained) == STEPS * BATCH * GROUP
    for t in trained:
        assert t["tokens"] > 0
        assert t["lineage"] == f"{t['traj_id']}@0", "carried from the first checkout by every hop"
        assert outcome["stored"][t["traj_id"]] == {"lineage": t["lineage"]}, "kept in the trajectory server's store"
    probe = outcome["handed_back"]
    assert probe["tokens"] > 0 and probe["lineage"] == f"{probe['traj_id']}@0", "the partial carried it back"
    (again,) = [t for t in trained if t["traj_id"] == probe["traj_id"]]
    assert again["tokens"] >= probe["tokens"], "routed again from what the trajectory server stored, then trained"


if __name__ == "__main__":
    state_dir = Path(sys.argv[1])
    (state_dir / "outcome.json").write_text(json.dumps(run_job(state_dir)))
