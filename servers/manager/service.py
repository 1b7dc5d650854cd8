"""``StalenessManager``: what the staleness manager's endpoints answer, over the durable ledger
(``store.DurableLedger``): the buffers and admission views, the transitions (awaited on the event
loop, committed before they return), reservations, consumption and the event log."""

from __future__ import annotations

import asyncio
import dataclasses

from staleflow import metrics as m
from staleflow.errors import ErrorCode
from staleflow.ledger import AdmissionWhatIf, BufferView, LedgerError, Transition
from staleflow.servers.manager.store import DurableLedger


def what_if_json(answer: AdmissionWhatIf) -> dict:
    return {**dataclasses.asdict(answer), "admissible": answer.admissible}


def buffer_json(view: BufferView) -> dict:
    return {
        "version": view.version,
        "state": view.state.value,
        "capacity": view.capacity,
        "entries": [{"group_id": e.group_id, "v_traj": e.v_traj, "status": e.status.value} for e in view.entries],
    }


def transition_json(t: Transition) -> dict:
    body: dict = {"group_id": t.group_id, "buffer": t.buffer, "cancelled": t.cancelled}
    if t.completed_members is not None:
        body["completed_members"] = t.completed_members
        body["occupied"] = t.op == "occupy"
    return body


class StalenessManager:
    """The staleness manager's answers over ``ledger``."""

    def __init__(self, ledger: DurableLedger):
        self.ledger = ledger

    def health(self) -> dict:
        return {"status": "ok", "train_version": self.ledger.train_version}

    def buffers(self) -> dict:
        led = self.ledger
        version, views, _ = led.snapshot()
        return {"train_version": version, "eta": led.params.eta, "batch_size": led.params.batch_size,
                "group_size": led.params.group_size, "buffers": [buffer_json(v) for v in views]}

    def buffer(self, version: int) -> dict:
        led = self.ledger
        current, views, _ = led.snapshot()
        for view in views:
            if view.version == version:
                return buffer_json(view)
        if version < current:
            groups = led.consumed_batch(version)
            return {"version": version, "state": "consumed", "capacity": led.params.batch_size,
                    "entries": [{"group_id": g, "status": "consumed"} for g in groups]}
        raise LedgerError(ErrorCode.UNKNOWN_BUFFER,
                          f"buffer {version} is not live yet: live buffers are {current}..{current + led.params.eta}")

    def admission(self, versions: list[int] | None, version: int | None, count: int | None) -> dict:
        if count is not None and version is None:
            raise LedgerError(ErrorCode.INVALID_REQUEST, "count needs a version: ask ?version=V&count=N")
        led = self.ledger
        table = led.admission(versions)
        body: dict = {"train_version": led.train_version, "eta": led.params.eta,
                      "admissible": {str(v): n for v, n in table.items()}}
        if version is not None:
            body["what_if"] = what_if_json(led.what_if(version, count or 1))
        return body

    async def transition(self, name: str, *args: object) -> dict:
        """One ledger transition (reserve, occupy, complete_member, abort), durable once it returns."""
        return transition_json(await self._submit(name, *args))

    async def _submit(self, name: str, *args: object) -> Transition:
        # awaited on the event loop: no worker-thread hop on the hot path
        return await asyncio.wrap_future(self.ledger.submit(name, *args))

    def reservation(self, group_id: str) -> dict:
        entry = self.ledger.entry(group_id)
        if entry is not None:
            return {"group_id": group_id, "v_traj": entry.v_traj, "status": entry.status.value,
                    "completed_members": list(entry.completed)}
        fate = self.ledger.fate(group_id)
        if fate is not None:
            return {"group_id": group_id, "status": fate.value}
        raise LedgerError(ErrorCode.UNKNOWN_GROUP, f"group {group_id!r} is not in the ledger")

    async def consume(self, version: int | None) -> dict:
        """Consume the next ready buffer; a retry naming an acknowledged ``version`` replays its result."""
        try:
            t = await self._submit("consume", version)
        except LedgerError as exc:
            if exc.code is not ErrorCode.ALREADY_CONSUMED or version is None:
                raise
            groups = self.ledger.consumed_batch(version)
            return {"version": version, "group_ids": groups, "cancelled": [], "replayed": True}
        return {"version": t.buffer, "group_ids": t.consumed, "cancelled": t.cancelled, "replayed": False}

    def events(self, after: int, limit: int) -> dict:
        rows = self.ledger.events(after, limit)
        return {"events": rows, "next": rows[-1]["id"] if rows else after}

    def metrics(self) -> list:
        """Prometheus view of the ledger, read at scrape time."""
        version, buffers, counts = self.ledger.snapshot()
        stats = self.ledger.stats
        return [
            m.LEDGER_TRAIN_VERSION.value(version),
            m.LEDGER_ENTRIES.family([(["reserved"], counts["reserved"]), (["occupied"], counts["occupied"])]),
            m.LEDGER_BUFFERS.family([([state], sum(b.state.value == state for b in buffers))
                                     for state in ("waiting", "ready", "stuck")]),
            m.LEDGER_ADMITTED.value(stats.admitted),
            m.LEDGER_OCCUPIED.value(stats.occupied),
            m.LEDGER_CONSUMED_GROUPS.value(stats.consumed_groups),
            m.LEDGER_CONSUMED_BUFFERS.value(stats.consumed_buffers),
            m.LEDGER_ABORTED_GROUPS.family([(["requested"], stats.aborted), (["surplus"], stats.surplus)]),
        ]
