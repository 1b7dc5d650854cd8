"""Completion-order consumption with counter admission: how AReaL and VeRL-Async really bound
staleness, as a stand-in for the ``Ledger`` inside the cluster simulation.

* **Admission** (AReaL's ``StalenessManager.get_capacity``; VeRL's rollouter pauses at
  ``(staleness_threshold + 1) x`` the batch's samples): new groups may start while
  ``accepted + running < (eta + v + 1) x B``, where ``v`` is the number of batches the trainer took
  and ``accepted + running`` every group started so far. One global counter, no per-group deadline.
* **Consumption**: the trainer takes the first ``B`` groups that completed, whatever version
  generated them (VeRL's MessageQueue, AReaL's output queue). A long group that started early may
  therefore be trained more than ``eta`` versions later: an *exceedance*, which the simulation
  counts and sizes instead of calling it a violation.

``bounded=False`` admits without limit (the pool's ``(eta + 1) x B`` groups in flight is then the
only cap): the upper bound's rule. Pure bookkeeping, the subset of the ``Ledger`` interface the
simulation uses.
"""

from __future__ import annotations

from collections import OrderedDict

from staleflow.config.manager import LedgerParams
from staleflow.ledger import LedgerError, Transition

UNBOUNDED = 1 << 40


class CompletionOrderLedger:
    def __init__(self, params: LedgerParams, bounded: bool = True):
        if params.group_redundancy or params.batch_redundancy:
            raise ValueError("completion-order consumption models no redundancy")
        self.params = params
        self.bounded = bounded
        self.train_version = 0  # batches taken by the trainer
        self.started = 0  # groups ever reserved (AReaL's accepted + running, consumed included)
        self._reserved: dict[str, int] = {}
        self._occupied: OrderedDict[str, int] = OrderedDict()  # completion order

    @property
    def capacity(self) -> int:
        return self.params.batch_size

    def admission(self) -> dict[int, int]:
        """The same count for every version an instance may be at (the counter knows no version)."""
        if self.bounded:
            free = (self.params.eta + self.train_version + 1) * self.params.batch_size - self.started
        else:
            free = UNBOUNDED
        return {v: max(0, free) for v in range(self.train_version + 1)}

    def reserve(self, group_id: str, v_traj: int) -> Transition:
        if group_id in self._reserved or group_id in self._occupied:
            raise LedgerError("duplicate_group", f"group {group_id} is already reserved")
        if self.bounded and not self.admission().get(min(v_traj, self.train_version), 0):
            raise LedgerError("not_admissible", "the in-flight counter is full")
        self._reserved[group_id] = v_traj
        self.started += 1
        return Transition("reserve", group_id)

    def occupy(self, group_id: str) -> Transition:
        try:
            v = self._reserved.pop(group_id)
        except KeyError:
            raise LedgerError("unknown_group", f"group {group_id} is not reserved") from None
        self._occupied[group_id] = v
        return Transition("occupy", group_id)

    def complete_member(self, group_id: str, traj_id: str) -> Transition:
        raise LedgerError("unsupported", "completion-order consumption models no group redundancy")

    def consume(self) -> Transition:
        b = self.params.batch_size
        if len(self._occupied) < b:
            raise LedgerError("not_ready", f"{len(self._occupied)} of {b} groups completed")
        taken = [self._occupied.popitem(last=False)[0] for _ in range(b)]
        buffer = self.train_version
        self.train_version += 1
        return Transition("consume", buffer=buffer, consumed=taken)

    def buffers(self) -> list:
        return []
