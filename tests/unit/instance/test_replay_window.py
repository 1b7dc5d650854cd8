"""The instance's window of recorded command responses stays within its count and byte bounds,
and a command still in it replays byte for byte."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from staleflow.servers.instance.service import ReplayWindow


def partial_body(i: int, tokens: int) -> dict:
    return {"command_id": f"c{i}", "kind": "interrupt", "seq": i,
            "partials": [{"traj_id": f"t{i}", "tokens": list(range(tokens)), "logprobs": [-0.5] * tokens}]}


@given(st.lists(st.integers(0, 2_000), min_size=1, max_size=60), st.integers(1, 20), st.integers(1, 50_000))
def test_the_window_keeps_the_newest_within_both_bounds(sizes: list[int], max_commands: int, max_bytes: int) -> None:
    window = ReplayWindow(max_commands, max_bytes)
    for i, tokens in enumerate(sizes):
        window.record(f"c{i}", f"f{i}", 200, partial_body(i, tokens))
        assert len(window) <= max_commands
        assert window.bytes <= max_bytes or len(window) == 1  # the newest alone may exceed the byte bound
    newest = window.get(f"c{len(sizes) - 1}")
    assert newest is not None and json.loads(newest.body) == partial_body(len(sizes) - 1, sizes[-1])
    kept = [i for i in range(len(sizes)) if window.get(f"c{i}") is not None]
    assert kept == list(range(len(sizes) - len(kept), len(sizes)))  # the oldest went first


def test_partials_do_not_pin_memory_by_count_alone() -> None:
    """Ten thousand commands of 1,000-token partials would be hundreds of megabytes; the byte
    bound holds the window at its budget however many commands there were."""
    window = ReplayWindow(10_000, 1 << 20)
    for i in range(500):
        window.record(f"c{i}", f"f{i}", 200, partial_body(i, 1_000))
    assert window.bytes <= 1 << 20 and 0 < len(window) < 500
