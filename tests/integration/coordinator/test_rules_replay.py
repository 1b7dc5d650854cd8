"""One set of rules: the cluster simulation and the trajectory server run the same state machine.

A simulated job records every event its trajectory pool receives (samples, checkouts, interrupted
trajectories handed back, completions, aborts acknowledged, consumes, frees); an instance failure is
added in the middle. The sequence is then replayed through both code paths: the simulation's
(``TrajectoryPool`` over an in-process ``Ledger``) and the trajectory server's (``TrajectoryServer``
over its SQLite ``TrajectoryStore``, the manager served over HTTP on loopback, the ledger's event
log followed as the server follows it). After every event both must agree on every trajectory's
state and instance, every group's state and V_traj, which groups are gone, what the ledger admits
and what each consume took.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest
from support import manager_config

from staleflow.api.base import ServiceError
from staleflow.api.manager import AsyncManagerClient
from staleflow.api.trajectories import Assignment, CheckoutRequest, CompletedIn, CompletedRequest, ReturnRequest
from staleflow.api.trajectory import FinishedPart, GeneratedPart
from staleflow.config import LedgerConfig
from staleflow.config.manager import LedgerParams
from staleflow.ledger import Ledger, LedgerError
from staleflow.servers.http import serve_in_thread
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.trajectories import TrajectoryServerConfig
from staleflow.servers.trajectories.service import TrajectoryServer
from staleflow.servers.trajectories.store import TrajectoryStore
from staleflow.simulation import ClusterSimulation, scenario
from staleflow.simulation.experiment import Point, SimulatedJob
from staleflow.simulation.systems import catalog
from staleflow.simulation.trajectory_pool import TrajectoryPool
from staleflow.trajectory_book import TrajectoryBook, TrajState

CI = scenario("ci", seed=0)
SYSTEMS = {s.name: s for s in catalog(CI.redundancy)}
ETA = 2
STEPS = 3
FAILED_INSTANCE = "inst-1"

Event = tuple


def record(system: str) -> tuple[list[Event], LedgerParams]:
    """The events a simulated job's trajectory pool received, with an instance failure in the middle."""
    sim = ClusterSimulation(SimulatedJob(Point(0, ETA, CI), SYSTEMS[system], 2, STEPS).config())
    events: list[Event] = []
    sim.pool.record = lambda *event: events.append(event)
    sim.run(STEPS)
    routed_there = next(i for i in range(len(events) // 2, len(events))
                        if events[i][0] == "checkout" and events[i][1] == FAILED_INSTANCE and events[i][2])
    events.insert(routed_there + 1, ("release", FAILED_INSTANCE))  # it fails right after a Route to it
    return events, sim.ledger.params


def ts_id(sim_id: str) -> str:
    """``s{k}-g{i}`` -> ``g{k*B+i}``, members ``/m{j}`` -> ``-m{j}``: the two namings of one prompt index."""
    group, _, member = sim_id.partition("/m")
    step, index = group[1:].split("-g")
    ts_group = f"g{int(step) * CI.workload.batch_size + int(index)}"
    return f"{ts_group}-m{member}" if member else ts_group


def book_view(book: TrajectoryBook, name: Callable[[str], str] = str) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for g in book.groups.values():
        out[name(g.group_id)] = ("group", g.state.value, g.v_traj)
    for t in book.trajs.values():
        out[name(t.traj_id)] = ("trajectory", t.state.value, t.instance_id)
    return out


class SimulationSide:
    """The simulation's code path: the trajectory pool over an in-process ledger."""

    def __init__(self, params: LedgerParams):
        self.ledger = Ledger(params)
        self.pool = TrajectoryPool(CI.workload, CI.workload.batch_size, params.group_members, params.group_size)

    def _known(self, ids: list[str]) -> list:
        return [self.pool.trajs[t] for t in ids if t in self.pool.trajs]

    async def apply(self, event: Event) -> object:
        kind, *args = event
        pool = self.pool
        if kind == "sample":
            pool.sample(len(args[0]))
        elif kind == "checkout":
            routed, _, _ = pool.checkout(args[0], list(args[1]), self.ledger.reserve)
            return sorted(t.traj_id for t in routed)
        elif kind == "returned":
            pool.returned(args[0], self._known(args[1]))
        elif kind == "completed":
            if args[1] in pool.trajs:
                pool.completed(args[0], pool.trajs[args[1]], self.ledger.occupy)
        elif kind == "cancelled":
            pool.cancelled(self._known(args[0]))
        elif kind == "consume":  # consume, read the batch, free it
            try:
                transition, _, _ = pool.consume(self.ledger.consume)
            except LedgerError as exc:
                return "refused", exc.code
            return sorted(transition.consumed or [])
        elif kind == "release":
            return pool.release(args[0])
        return None  # "free": the trainer frees a batch as it consumes it (both sides)

    async def admission(self) -> dict[int, int]:
        return {v: n for v, n in self.ledger.admission().items() if n}

    def view(self) -> dict[str, tuple]:
        pool = self.pool
        shown = pool.pending()  # what the strategies see: the book's pending trajectories, in its order
        assert [p.traj_id for p in shown] == list(pool.book.in_state(TrajState.PENDING))
        assert all(p.v_traj == pool.book.groups[p.group_id].v_traj for p in shown)
        assert all(p.length == pool.trajs[p.traj_id].context for p in shown)
        return book_view(pool.book, ts_id)


class ServerSide:
    """The trajectory server's code path: its service and durable store, the manager over HTTP."""

    def __init__(self, tmp_path: Path, stack: ExitStack, params: LedgerParams):
        ledger = dict(eta=params.eta, batch_size=params.batch_size, group_size=params.group_size,
                      batch_redundancy=params.batch_redundancy, group_redundancy=params.group_redundancy)
        manager_url = stack.enter_context(serve_in_thread(manager_app(manager_config(tmp_path, **ledger)))).url
        config = TrajectoryServerConfig(ledger=LedgerConfig(**ledger), manager_url=manager_url, state_dir=tmp_path)
        self.store = TrajectoryStore.open(config.database_url())
        stack.callback(self.store.close)
        self.manager = AsyncManagerClient(manager_url)
        self.server = TrajectoryServer(config, self.store, self.manager, self._reward)
        self.members, self.needed = params.group_members, params.group_size
        self.cursor = 0

    @staticmethod
    async def _reward(batch: list[tuple[str, str, str]]) -> list[tuple[float, str]]:
        return [(0.0, "replayed")] * len(batch)

    async def _follow_ledger(self) -> None:
        while True:
            page = await self.manager.events(after=self.cursor)
            for event in page.events:
                self.server.apply_ledger_event(event)
            if page.next == self.cursor:
                return
            self.cursor = page.next

    async def apply(self, event: Event) -> object:
        kind, *args = event
        store = self.store
        if kind == "sample":  # the same prompt indices (the server may have sampled them already)
            missing = [(i, f"prompt {i}", "0", (1, 2, 3)) for i in args[0] if f"g{i}" not in store.groups]
            if missing:
                store.add_groups(missing, self.members, self.needed, missing[-1][0] + 1)
        elif kind == "checkout":
            assignments = [Assignment(traj_id=ts_id(t), v_traj=v) for t, v in args[1]]
            reply = await self.server.checkout(CheckoutRequest(instance_id=args[0], assignments=assignments))
            await self._follow_ledger()
            return sorted(t.traj_id for t in reply.trajectories)
        elif kind == "returned":
            await self.server.returned(ReturnRequest(instance_id=args[0],
                                                     partials=[GeneratedPart(traj_id=ts_id(t)) for t in args[1]]))
        elif kind == "completed":
            item = CompletedIn(trajectory=FinishedPart(traj_id=ts_id(args[1]), finish_reason="stop"))
            await self.server.completed(CompletedRequest(instance_id=args[0], items=[item]))
            await self.server.process_completed()
            await self._follow_ledger()
        elif kind == "cancelled":
            store.cancelled([ts_id(t) for t in args[0]])
        elif kind == "consume":
            try:
                reply = await self.manager.consume()
            except ServiceError as exc:
                return "refused", exc.code
            await self._follow_ledger()
            await self.server.batch(reply.version)  # what the trainer reads, then frees
            store.free(reply.group_ids)
            return sorted(reply.group_ids)
        elif kind == "release":
            return store.release_instance(args[0])
        return None

    async def admission(self) -> dict[int, int]:
        return {v: n for v, n in (await self.manager.admission()).by_version().items() if n}

    def view(self, ids: set[str]) -> dict[str, tuple]:
        return {k: v for k, v in book_view(self.store.book).items() if k in ids}


async def replay(events: list[Event], sim: SimulationSide, ts: ServerSide) -> tuple[int, list[object]]:
    """Feed both sides every event; fail at the first one after which they disagree. Returns how
    many trajectory and group records were compared, and each event's outcome."""
    sampled: set[str] = set()
    compared = 0
    outcomes = []
    for n, event in enumerate(events):
        sim_out = await sim.apply(event)
        ts_out = await ts.apply(event)
        if event[0] == "checkout":
            sim_out = sorted(ts_id(t) for t in sim_out)  # type: ignore[union-attr]
        elif event[0] == "consume" and isinstance(sim_out, list):
            sim_out = sorted(ts_id(g) for g in sim_out)
        assert sim_out == ts_out, f"event {n} {event[:2]}: the simulation gave {sim_out}, the server {ts_out}"
        outcomes.append(sim_out)
        expected = sim.view()
        sampled.update(expected)
        got = ts.view(sampled)
        assert got == expected, f"after event {n} {event[:2]}: " + "; ".join(
            f"{k}: simulation {expected.get(k)}, server {got.get(k)}" for k in sorted(set(expected) | set(got))
            if expected.get(k) != got.get(k))
        assert await sim.admission() == await ts.admission(), f"after event {n}: the ledgers admit differently"
        compared += len(expected)
    return compared, outcomes


@pytest.mark.parametrize("system", ["sf-rsm+batch", "sf-rsm+group", "in-flight"])
def test_the_simulation_and_the_trajectory_server_follow_one_set_of_rules(tmp_path: Path, system: str) -> None:
    """Redundancy (the ledger cancels groups and members: aborts on instances), and a global
    sync whose instances resume their own trajectories (handed back and checked out again)."""
    events, params = record(system)
    kinds = {e[0] for e in events}
    assert {"sample", "checkout", "returned", "completed", "consume", "free", "release"} <= kinds
    assert ("cancelled" in kinds) == bool(params.batch_redundancy or params.group_redundancy)

    async def main() -> tuple[int, list[object]]:
        with ExitStack() as stack:
            ts = ServerSide(tmp_path, stack, params)
            try:
                return await replay(events, SimulationSide(params), ts)
            finally:
                await ts.manager.aclose()

    compared, outcomes = asyncio.run(main())
    assert compared > 1000
    assert outcomes[events.index(("release", FAILED_INSTANCE))], "the failed instance held trajectories"
    assert any(isinstance(o, list) and o for o, e in zip(outcomes, events, strict=True) if e[0] == "consume")


def test_the_replay_catches_a_rule_changed_on_one_side(tmp_path: Path) -> None:
    """If the simulation's side had its own rule (here: a trajectory handed back by an
    interrupted instance stays routed there), the replay fails at the first event it changes."""
    events, params = record("sf-rsm+batch")
    sim = SimulationSide(params)

    def keeps_them_routed(partials, instance_id):  # a rule the trajectory server does not have
        return {p.traj_id: "ignored" for p in partials}, []

    sim.pool.book.returned = keeps_them_routed  # type: ignore[method-assign]

    async def main() -> None:
        with ExitStack() as stack:
            ts = ServerSide(tmp_path, stack, params)
            try:
                await replay(events, sim, ts)
            finally:
                await ts.manager.aclose()

    first_return = next(n for n, e in enumerate(events) if e[0] == "returned" and e[2])
    with pytest.raises(AssertionError, match=rf"after event {first_return} \('returned'.*simulation \('trajectory', "
                                             rf"'routed'.*server \('trajectory', 'pending'"):
        asyncio.run(main())
