"""The trajectory server's side of its contract (``staleflow.api.trajectories``): the vocabulary's
trajectories (``staleflow.api.trajectory``) into the book's records, and its store's records back
into the vocabulary."""

from __future__ import annotations

from typing import Any

from staleflow.api.trajectories import TrajectoryDetail, TrajectorySummary
from staleflow.api.trajectory import (
    FinishedPart,
    GeneratedPart,
    ProgressPart,
    ResponseFields,
    TrainingTrajectory,
    WireSampling,
    WireTrajectory,
)
from staleflow.config import SamplingConfig
from staleflow.servers.trajectories.store import prompt_key
from staleflow.trajectory_book import Generated, GroupRecord, ProgressCheckpoint, TrajRecord


def wire_sampling(sampling: SamplingConfig) -> WireSampling:
    """The job's sampling as every trajectory carries it (a setting the vocabulary lacks is an error)."""
    return WireSampling(**sampling.model_dump())


STORED_RESPONSE_FIELDS = frozenset({"traj_id", "tokens", "logprobs", "segments"})
"""The response's fields the store keeps in columns of their own; it keeps the others as they come."""


def carried_fields() -> set[str]:
    """The response's fields the store keeps without reading them (``Generated.carried``)."""
    return set(ResponseFields.model_fields) - STORED_RESPONSE_FIELDS


def generated(part: GeneratedPart, instance_id: str | None = None) -> Generated:
    """What an instance generated (a returned partial, or a completion), as the book takes it."""
    carried = carried_fields()
    return Generated(part.traj_id, tuple(part.tokens), tuple(part.logprobs),
                     tuple((s.version, s.start, s.end) for s in part.segments),
                     part.finish_reason if isinstance(part, FinishedPart) else None, instance_id,
                     part.model_dump(mode="json", include=carried) if carried else None)


def progress_checkpoint(part: ProgressPart, instance_id: str) -> ProgressCheckpoint:
    return ProgressCheckpoint(part.traj_id, instance_id, part.start, tuple(part.tokens), tuple(part.logprobs),
                              tuple((s.version, s.start, s.end) for s in part.segments))


def _trajectory_fields(t: TrajRecord, g: GroupRecord, sampling: WireSampling) -> dict[str, Any]:
    carried = {k: v for k, v in t.carried.items() if k in carried_fields()} if t.carried else {}
    return {"traj_id": t.traj_id, "group_id": g.group_id, "prompt_ids": g.prompt_ids, "v_traj": g.v_traj,
            "sampling": sampling, "tokens": t.tokens, "logprobs": t.logprobs,
            "segments": [{"version": v, "start": s, "end": e} for v, s, e in t.segments], **carried}


def wire_trajectory(t: TrajRecord, g: GroupRecord, sampling: WireSampling) -> WireTrajectory:
    """The trajectory as an instance's Route command carries it."""
    return WireTrajectory.model_validate(_trajectory_fields(t, g, sampling))


def training_trajectory(t: TrajRecord, g: GroupRecord, sampling: WireSampling) -> TrainingTrajectory:
    return TrainingTrajectory.model_validate({**_trajectory_fields(t, g, sampling), "reward": t.reward,
                                              "finish_reason": t.finish_reason, "answer": g.answer})


def _summary_fields(t: TrajRecord, g: GroupRecord) -> dict[str, Any]:
    return {"traj_id": t.traj_id, "group_id": g.group_id, "state": t.state.value, "v_traj": g.v_traj,
            "length": len(g.prompt_ids) + len(t.tokens), "generated": len(t.tokens), "instance_id": t.instance_id,
            "seq": t.seq, "prompt_key": prompt_key(g)}


def summary(t: TrajRecord, g: GroupRecord) -> TrajectorySummary:
    return TrajectorySummary.model_validate(_summary_fields(t, g))


def detail(t: TrajRecord, g: GroupRecord, sampling: WireSampling, held_on_instance: int | None) -> TrajectoryDetail:
    return TrajectoryDetail.model_validate({
        **_summary_fields(t, g), **_trajectory_fields(t, g, sampling), "reward": t.reward,
        "reward_reason": t.reward_reason, "finish_reason": t.finish_reason, "prompt_text": g.prompt_text,
        "held_on_instance": held_on_instance})
