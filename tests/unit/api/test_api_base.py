"""The contract layer's base: a route declared once becomes a call's request, and transient
failures are retried with backoff while others are raised at once."""

from __future__ import annotations

import threading
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleflow.api.base import RetriesStopped, Route, ServiceError, retry_transient, transient
from staleflow.api.manager import ManagerRoutes, ReservationRequest
from staleflow.api.params import ParamsRoutes
from staleflow.backoff import Backoff


def test_a_call_fills_path_then_body_then_query_parameters() -> None:
    request = ManagerRoutes.reserve.request("g1", 3)
    assert (request.method, request.path, request.json, request.query) == ("POST", "/v1/reservations",
                                                                           {"group_id": "g1", "v_traj": 3}, {})
    assert ManagerRoutes.complete_member.request("g1", member_id="m0").path == "/v1/reservations/g1/members/m0/complete"
    assert ManagerRoutes.consume.request().query == {}  # an absent query parameter is left out
    assert ManagerRoutes.consume.request(version=4).query == {"version": 4}
    finish = ParamsRoutes.finish_part.request(7, 1, push_id="p", checksums={0: "ab"}, wait_s=2.0, timeout=9.0)
    assert (finish.path, finish.query, finish.json, finish.options) == (
        "/v1/params/7/parts/1/done", {"push_id": "p"}, {"checksums": {"0": "ab"}, "wait_s": 2.0}, {"timeout": 9.0})
    assert ParamsRoutes.chunk.target(3, 5, lease="L 1") == "/v1/params/3/chunks/5?lease=L+1"
    assert ManagerRoutes.buffers.url("http://h:1/") == "http://h:1/v1/buffers"


def test_a_body_given_as_models_goes_as_their_json() -> None:
    assert ManagerRoutes.reserve.request(**ReservationRequest(group_id="g", v_traj=0).model_dump()).json == {
        "group_id": "g", "v_traj": 0}
    checkout = Route("POST", "/v1/x", None, body=ReservationRequest)
    assert checkout.request(group_id="g").json == {"group_id": "g"}  # the server validates what is missing


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((), {"group": "g"}, "has no parameter 'group'"),
    (("g", 1, 2), {}, "takes 2 arguments"),
    (("g",), {"group_id": "g"}, "got 'group_id' twice"),
    ((), {}, "missing path parameter 'group_id'"),
])
def test_a_wrong_call_is_a_type_error_naming_the_parameters(args: tuple, kwargs: dict, match: str) -> None:
    route = ManagerRoutes.occupy if match.startswith("missing") else ManagerRoutes.reserve
    with pytest.raises(TypeError, match=match):
        route.request(*args, **kwargs)


@given(st.text(min_size=1, max_size=20), st.integers(min_value=0, max_value=2**62))
def test_path_parameters_land_in_their_place(group: str, version: int) -> None:
    path = ManagerRoutes.reservation.request(group).path
    assert path.startswith("/v1/reservations/") and unquote(path.removeprefix("/v1/reservations/")) == group
    assert "?" not in path and "#" not in path and path.count("/") == 3
    assert ManagerRoutes.buffer.request(version).path == f"/v1/buffers/{version}"


def _failing(failures: list[Exception], result: str = "ok"):
    calls = []

    def call() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return result

    return call, calls


def test_transient_failures_are_retried_until_the_call_succeeds() -> None:
    request = httpx.Request("GET", "http://127.0.0.1:9/v1/health")
    call, calls = _failing([httpx.ConnectError("refused", request=request), ServiceError(503, "restarting"),
                            ConnectionResetError()])
    fast = Backoff(0.001, 0.002)
    assert retry_transient("ask", call, threading.Event(), backoff=fast) == "ok" and len(calls) == 4


def test_a_refusal_is_raised_at_once_and_a_long_outage_gives_up() -> None:
    call, calls = _failing([ServiceError(409, "not ready", {"code": "not_ready"})])
    with pytest.raises(ServiceError):
        retry_transient("consume", call, threading.Event())
    assert len(calls) == 1 and not transient(ServiceError(404, "gone")) and transient(ServiceError(502, "upstream"))
    down, _ = _failing([ServiceError(503, "down")] * 1000)
    with pytest.raises(RuntimeError, match="still failing after 0 s"):
        retry_transient("ask", down, threading.Event(), outage_s=0.01, backoff=Backoff(0.005, 0.005))


def test_a_stop_ends_the_retries() -> None:
    """A stop set while the service is down (here: on its third failure) ends the retries."""
    stop = threading.Event()
    failing, calls = _failing([ServiceError(503, "down")] * 1000)

    def down() -> str:
        if len(calls) == 2:
            stop.set()
        return failing()

    with pytest.raises(RetriesStopped):
        retry_transient("ask", down, stop, backoff=Backoff(0.005, 0.01))
    assert len(calls) == 3
