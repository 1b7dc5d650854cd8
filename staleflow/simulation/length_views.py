"""What the simulated coordinator predicts of response lengths (``LengthPredictor``), from what
a real one sees: completed trajectories' lengths, and the tokens the trajectory server holds of
the others (a partial's, after an Interrupt; 0 for one that has run uninterrupted since routed).
It feeds length-aware routing (``PendingTrajectory.remaining``) and adaptive redundancy (the
admission ``over_reservation`` withholds). Never the workload's parameters or true lengths."""

from __future__ import annotations

from collections.abc import Sequence

from staleflow.config.strategy import StrategyConfig
from staleflow.length_prediction import LengthPredictor
from staleflow.simulation.trajectory_pool import SimTrajectory, TrajectoryPool
from staleflow.strategies import PendingTrajectory
from staleflow.strategies.over_reservation import extra_groups, predicted_tail, spare_admission
from staleflow.trajectory_book import GroupRecord, GroupState, TrajState

_UNFINISHED = (TrajState.PENDING, TrajState.ROUTED)


class PredictedLengths:
    def __init__(self, pool: TrajectoryPool, max_tokens: int):
        self.pool = pool
        self.predictor = LengthPredictor(max_tokens=max_tokens)

    def finished(self, traj: SimTrajectory) -> None:
        self.predictor.finished(traj.group.group_id, traj.generated)

    def forget(self, group_ids: Sequence[str]) -> None:
        for group_id in group_ids:
            self.predictor.forget_group(group_id)

    def _remainders(self, group: GroupRecord) -> dict[str, float]:
        """Predicted tokens still to come of each unfinished member of ``group``."""
        trajs = self.pool.trajs
        book = self.pool.book.trajs
        members = [m for m in group.member_ids if book[m].state in _UNFINISHED]
        generated = [trajs[m].generated for m in members]
        predicted = self.predictor.predict_members(group.group_id, generated)
        return {m: p - g for m, p, g in zip(members, predicted, generated, strict=True)}

    def with_remainders(self, pending: list[PendingTrajectory]) -> list[PendingTrajectory]:
        """``pending`` with each versioned trajectory's predicted remainder (initial ones keep 0:
        a prompt the simulation never samples twice has nothing but the prior, the same for all)."""
        by_group: dict[str, dict[str, float]] = {}
        out = []
        for p in pending:
            if p.v_traj is None:
                out.append(p)
                continue
            remainders = by_group.get(p.group_id)
            if remainders is None:
                remainders = by_group[p.group_id] = self._remainders(self.pool.trajs[p.traj_id].group)
            out.append(PendingTrajectory(p.traj_id, p.group_id, p.v_traj, p.length, p.seq,
                                         remainders.get(p.traj_id, 0.0)))
        return out

    def tail(self) -> float:
        """The predicted tail of the reserved groups with the oldest V_traj (those the next
        buffer waits for), over a typical trajectory's length."""
        reserved = [g for g in self.pool.book.groups.values() if g.state is GroupState.RESERVED]
        if not reserved:
            return 0.0
        oldest = min(g.v_traj for g in reserved if g.v_traj is not None)
        remainders = [r for g in reserved if g.v_traj == oldest for r in self._remainders(g).values()]
        return predicted_tail(remainders, self.predictor.typical_length())

    def spare_admission(self, admission: dict[int, int], config: StrategyConfig, eta: int,
                        surplus_per_buffer: int) -> dict[int, int]:
        """The admission table with the extra groups the predicted tail does not call for withheld."""
        if not any(admission.values()):
            return admission  # nothing to withhold: the tail need not be predicted
        unused = surplus_per_buffer - extra_groups(self.tail(), surplus_per_buffer, config.tail_threshold)
        return spare_admission(admission, eta, unused)
