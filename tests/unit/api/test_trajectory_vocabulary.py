"""The trajectory vocabulary on the wire: the JSON every hop sends keeps the fields it had, the
shapes older senders use are still read, and the conversions at both ends (the instance's engine
types, the trajectory server's book records) lose nothing."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from staleflow.api.instance import Command, PullCommand, RouteCommand
from staleflow.api.trajectories import CheckedOut, CompletedRequest, ReturnRequest
from staleflow.api.trajectory import ProgressPart, WireTrajectory
from staleflow.config import SamplingConfig
from staleflow.engines.base import CompletedTrajectory, FinishReason, PartialTrajectory
from staleflow.servers.instance.wire import engine_request, finished_trajectory, wire_trajectory
from staleflow.servers.trajectories.wire import generated, wire_sampling
from staleflow.servers.trajectories.wire import wire_trajectory as rendered
from staleflow.trajectory_book import GroupRecord, GroupState, TrajRecord, TrajState

TRAJECTORY_KEYS = {"traj_id", "group_id", "prompt_ids", "v_traj", "sampling", "tokens", "logprobs", "segments"}
SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"}


@st.composite
def trajectories(draw: st.DrawFn) -> dict[str, Any]:
    """A trajectory's JSON as a route command carries it: a response of contiguous segments."""
    cuts = sorted(draw(st.sets(st.integers(1, 40), max_size=4)))
    n = cuts[-1] if cuts else 0
    starts = [0, *cuts[:-1]] if cuts else []
    versions = sorted(draw(st.lists(st.integers(0, 9), min_size=len(cuts), max_size=len(cuts))))
    max_tokens = draw(st.integers(n + 1, n + 64))
    return {
        "traj_id": draw(st.from_regex(r"[a-z][a-z0-9/-]{0,20}", fullmatch=True)),
        "group_id": draw(st.text("gxyz0123", min_size=1, max_size=8)),
        "prompt_ids": draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8)),
        "v_traj": min(versions, default=draw(st.integers(0, 9))),
        "sampling": {"max_tokens": max_tokens, "temperature": draw(st.sampled_from([0.0, 0.7, 1.0])),
                     "top_p": 1.0, "top_k": -1, "seed": draw(st.none() | st.integers(0, 99)),
                     "stop_token_ids": [], "ignore_eos": draw(st.booleans())},
        "tokens": draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)),
        "logprobs": draw(st.lists(st.floats(-30.0, 0.0), min_size=n, max_size=n)),
        "segments": [{"version": v, "start": s, "end": e} for v, s, e in zip(versions, starts, cuts, strict=True)],
    }


@settings(max_examples=60, deadline=None)
@given(trajectories(), st.sampled_from(list(FinishReason)))
def test_a_trajectory_crosses_the_instance_and_comes_back_as_it_went(wire: dict[str, Any], reason: FinishReason) -> None:
    """Route JSON -> the instance's command -> the engine's request -> its partial and its
    completion -> the JSON they leave with: the same fields, the same values."""
    command = TypeAdapter(Command).validate_python({"command_id": "c1", "kind": "route", "trajectories": [wire]})
    assert isinstance(command, RouteCommand)
    request = engine_request(command.trajectories[0])
    partial = wire_trajectory(PartialTrajectory(**vars(request)))
    assert partial.model_dump(mode="json") == wire and set(wire) == TRAJECTORY_KEYS
    finished = finished_trajectory(CompletedTrajectory(**vars(request), finish_reason=reason))
    assert finished.model_dump(mode="json") == {**wire, "finish_reason": reason.value}
    # what the trajectory server reads of it, as the instance posts it
    body = {"instance_id": "i0", "items": [{"seq": 1, "instance_id": "i0", "finished_at": 0.0,
                                            "trajectory": finished.model_dump(mode="json")}]}
    got = generated(CompletedRequest.model_validate(body).items[0].trajectory, "i0")
    assert (list(got.tokens), list(got.logprobs), got.finish_reason) == (wire["tokens"], wire["logprobs"], reason.value)
    assert [list(s) for s in got.segments] == [[s["version"], s["start"], s["end"]] for s in wire["segments"]]


@settings(max_examples=60, deadline=None)
@given(trajectories())
def test_the_trajectory_server_renders_what_it_stored(wire: dict[str, Any]) -> None:
    """A partial handed back, kept in the book's record, rendered into the next checkout."""
    part = ReturnRequest.model_validate({"partials": [wire]}).partials[0]  # a whole trajectory is a partial
    kept = generated(part)
    group = GroupRecord(wire["group_id"], 0, "", "", tuple(wire["prompt_ids"]), 2, 2, wire["v_traj"],
                        GroupState.RESERVED, 1, 0.0)
    record = TrajRecord(wire["traj_id"], wire["group_id"], TrajState.PENDING, 1, None, kept.tokens, kept.logprobs,
                        kept.segments)
    sampling = wire_sampling(SamplingConfig.model_validate({k: wire["sampling"][k] for k in SamplingConfig.model_fields}))
    out = rendered(record, group, sampling).model_dump(mode="json")
    assert out == {**wire, "sampling": {**wire["sampling"], "top_k": -1, "seed": None, "stop_token_ids": [],
                                        "ignore_eos": False}}
    assert CheckedOut.model_validate({"trajectories": [out], "refused": []}).trajectories[0] == WireTrajectory(**out)


def test_the_shapes_older_senders_use_are_still_read() -> None:
    # the trajectory server's checkout answer named three sampling settings only
    old = {"traj_id": "g0-m0", "group_id": "g0", "prompt_ids": [1, 2], "v_traj": 0,
           "sampling": {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0}, "tokens": [], "logprobs": [],
           "segments": []}
    (t,) = CheckedOut.model_validate({"trajectories": [old], "refused": []}).trajectories
    assert set(t.sampling.model_dump()) == SAMPLING_KEYS and t.sampling.max_tokens == 8
    # a pull without weights or keep_running; a route whose kind is spelt out
    pull = TypeAdapter(Command).validate_python({"command_id": "p", "kind": "pull", "version": 2})
    assert isinstance(pull, PullCommand) and pull.weights is None and not pull.keep_running
    assert TypeAdapter(Command).validate_python({"command_id": "r", "kind": "route", "trajectories": [old]}).kind == "route"
    # bare partials (reconciliation) and completions without the trajectory's identity (older instances)
    assert ReturnRequest.model_validate({"partials": [{"traj_id": "g0-m0"}]}).partials[0].tokens == []
    done = CompletedRequest.model_validate({"instance_id": "i0", "items": [
        {"trajectory": {"traj_id": "g0-m0", "finish_reason": "stop"}}]})
    assert done.items[0].trajectory.finish_reason == "stop"
    # a progress checkpoint keeps its rules: segments end at its last token
    assert ProgressPart.model_validate({"traj_id": "t", "start": 1, "tokens": [5], "logprobs": [-1.0],
                                        "segments": [{"version": 0, "start": 0, "end": 2}]}).start == 1


def test_commands_built_by_the_coordinator_carry_their_kind() -> None:
    command = RouteCommand(command_id="c1", trajectories=[WireTrajectory(
        traj_id="t", group_id="g", prompt_ids=[1], v_traj=0, sampling={"max_tokens": 4})])
    sent = command.model_dump(mode="json")
    assert sent["kind"] == "route" and set(sent["trajectories"][0]) == TRAJECTORY_KEYS
    assert TypeAdapter(Command).validate_python(sent) == command
