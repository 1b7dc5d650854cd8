"""The instance server's side of its contract (``staleflow.api.instance``): wire models into engine
requests and weights references, engine trajectories into wire JSON."""

from __future__ import annotations

import base64
from dataclasses import asdict
from typing import Any

from staleflow.api.instance import ParamsWeightsIn, PathWeightsIn, PullCommand, SimWeightsIn, TrajectoryIn
from staleflow.engines.base import (
    CompletedTrajectory,
    EngineError,
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


def engine_request(t: TrajectoryIn) -> TrajectoryRequest:
    return TrajectoryRequest(
        **t.model_dump(exclude={"sampling", "segments"}),
        sampling=SamplingParams(**t.sampling.model_dump()),
        segments=tuple(Segment(**s.model_dump()) for s in t.segments),
    )


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


def trajectory_json(t: Trajectory) -> dict[str, Any]:
    data: dict[str, Any] = {
        "traj_id": t.traj_id,
        "group_id": t.group_id,
        "prompt_ids": list(t.prompt_ids),
        "v_traj": t.v_traj,
        "sampling": {**asdict(t.sampling), "stop_token_ids": list(t.sampling.stop_token_ids)},
        "tokens": list(t.tokens),
        "logprobs": list(t.logprobs),
        "segments": [{"version": s.version, "start": s.start, "end": s.end} for s in t.segments],
    }
    if isinstance(t, CompletedTrajectory):
        data["finish_reason"] = t.finish_reason.value
    return data
