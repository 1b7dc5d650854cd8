"""The instance server's side of its contract (``staleflow.api.instance``): the vocabulary's
trajectories (``staleflow.api.trajectory``) into engine requests, weights references into the
engine's, and the engine's trajectories and progress back into the vocabulary. Fields pass by name:
a field both sides declare needs no edit here, and one the engine does not know is carried by the
instance (``carried_by_instance``) and handed back with the trajectory."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

from staleflow.api.instance import ParamsWeightsIn, PathWeightsIn, PullCommand, SimWeightsIn
from staleflow.api.trajectory import FinishedTrajectory, ProgressPart, WireSegment, WireTrajectory
from staleflow.engines.base import (
    CompletedTrajectory,
    EngineError,
    PartialTrajectory,
    Progress,
    SamplingParams,
    Segment,
    SimWeights,
    Trajectory,
    TrajectoryRequest,
    WeightsBlob,
    WeightsFromParams,
    WeightsPath,
    WeightsRef,
)
from staleflow.errors import ErrorCode

ENGINE_FIELDS = frozenset(f.name for f in fields(TrajectoryRequest))


def engine_request(t: WireTrajectory) -> TrajectoryRequest:
    return TrajectoryRequest(
        **t.model_dump(include=set(ENGINE_FIELDS - {"sampling", "segments"})),
        sampling=SamplingParams(**t.sampling.model_dump()),
        segments=tuple(Segment(**s.model_dump()) for s in t.segments),
    )


def carried_by_instance(t: WireTrajectory) -> dict[str, Any]:
    """The trajectory's fields the engine does not know (usually none): the instance keeps them
    while the trajectory runs and hands them back with its partial or its completion."""
    return t.model_dump(exclude=set(ENGINE_FIELDS))


def weights_ref(command: PullCommand) -> WeightsRef:
    w = command.weights
    if w is None or isinstance(w, SimWeightsIn):
        return SimWeights(command.version, None if w is None else w.size_bytes)
    if isinstance(w, PathWeightsIn):
        return WeightsPath(command.version, w.path)
    if isinstance(w, ParamsWeightsIn):
        return WeightsFromParams(command.version, w.url, w.transport)
    try:
        return WeightsBlob(command.version, base64.b64decode(w.data_b64, validate=True))
    except ValueError as exc:  # binascii.Error, or characters outside ASCII
        raise EngineError(ErrorCode.INVALID_WEIGHTS, f"weights.data_b64 is not base64: {exc}") from None


def wire_segments(segments: tuple[Segment, ...]) -> list[WireSegment]:
    return [WireSegment(version=s.version, start=s.start, end=s.end) for s in segments]


def _wire_fields(t: Trajectory | Progress) -> dict[str, Any]:
    """The dataclass's fields, by name (not ``asdict``: that would copy every token one by one)."""
    out = {f.name: getattr(t, f.name) for f in fields(t)}
    out["segments"] = wire_segments(t.segments)
    return out


def _whole_fields(t: Trajectory, carried: Mapping[str, Any] | None) -> dict[str, Any]:
    return {**(carried or {}), **_wire_fields(t), "sampling": asdict(t.sampling)}


def wire_trajectory(t: PartialTrajectory, carried: Mapping[str, Any] | None = None) -> WireTrajectory:
    """An engine's partial as the vocabulary carries it, with the fields the instance ``carried`` for it."""
    return WireTrajectory.model_validate(_whole_fields(t, carried))


def finished_trajectory(t: CompletedTrajectory, carried: Mapping[str, Any] | None = None) -> FinishedTrajectory:
    """An engine's finished trajectory as the vocabulary carries it, with what the instance ``carried``."""
    return FinishedTrajectory.model_validate({**_whole_fields(t, carried), "finish_reason": t.finish_reason.value})


def progress_part(p: Progress, carried: Mapping[str, Any] | None = None) -> ProgressPart:
    return ProgressPart.model_validate({**(carried or {}), **_wire_fields(p)})
