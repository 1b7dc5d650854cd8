"""The staleness manager's REST contract, over real HTTP on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import manager_config

from staleflow.api.base import ServiceError
from staleflow.api.manager import ManagerClient
from staleflow.servers.http import serve_in_thread
from staleflow.servers.manager import create_app
from staleflow.servers.manager.store import DurableLedger, SettingsMismatch


def test_lifecycle_over_http(manager: ManagerClient) -> None:
    assert manager.admission().by_version() == {0: 4}
    assert manager.reserve("g1", 0).model_dump(exclude_none=True) == {"group_id": "g1", "buffer": 1, "cancelled": []}
    assert manager.reserve("g2", 0).buffer == 1
    assert manager.reserve("g3", 0).buffer == 0
    data = manager.buffers()
    assert data.train_version == 0 and data.eta == 1 and data.batch_size == 2
    assert [(b.version, b.state, b.capacity) for b in data.buffers] == [(0, "waiting", 2), (1, "stuck", 2)]
    assert manager.occupy("g1").buffer == 0
    assert manager.occupy("g3").buffer == 0
    head = manager.buffer(0)
    assert head.state == "ready" and {e.group_id for e in head.entries} == {"g1", "g3"}
    consumed = manager.consume()
    assert consumed.version == 0 and sorted(consumed.group_ids) == ["g1", "g3"]
    assert manager.buffer(0).state == "consumed"
    assert manager.reservation("g1").status == "consumed"
    assert manager.abort("g2").group_id == "g2"
    assert manager.reservation("g2").status == "aborted"
    events = manager.events().events
    assert [e["op"] for e in events] == ["reserve"] * 3 + ["occupy"] * 2 + ["consume", "abort"]
    assert manager.events(after=events[-2]["id"]).events[0]["op"] == "abort"


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/reservations", {"group_id": "x", "v_traj": -1}, 422),
        ("POST", "/v1/reservations", {"group_id": "x", "v_traj": 5}, 422),  # newer than the trainer
        ("POST", "/v1/reservations", {"group_id": "x", "v_traj": "0"}, 422),  # wrong type
        ("POST", "/v1/reservations", {"group_id": "x", "v_traj": True}, 422),
        ("POST", "/v1/reservations", {"group_id": "", "v_traj": 0}, 422),
        ("POST", "/v1/reservations", {"group_id": "a b", "v_traj": 0}, 422),
        ("POST", "/v1/reservations", {"v_traj": 0}, 422),
        ("POST", "/v1/reservations", {"group_id": "taken", "v_traj": 0}, 409),  # duplicate
        ("POST", "/v1/reservations", "not json", 422),
        ("POST", "/v1/reservations/ghost/occupy", None, 404),
        ("POST", "/v1/reservations/taken/occupy", None, 200),
        ("DELETE", "/v1/reservations/ghost", None, 404),
        ("POST", "/v1/consume", None, 409),
        ("GET", "/v1/buffers/-1", None, 422),
        ("GET", "/v1/buffers/99", None, 404),
        ("GET", "/v1/admission?versions=-3", None, 422),
        ("GET", "/v1/admission?version=-1", None, 422),
        ("GET", "/v1/admission?version=0&count=0", None, 422),
        ("GET", "/v1/admission?count=2", None, 422),  # a count needs a version
        ("GET", "/v1/events?limit=0", None, 422),
    ],
)
def test_bad_requests_get_4xx_and_leave_state_untouched(
    manager: ManagerClient, method: str, path: str, body: object, status: int
) -> None:
    manager.reserve("taken", 0)
    before = manager.buffers()
    kwargs = {"content": body} if isinstance(body, str) else {"json": body} if body is not None else {}
    response = manager.http.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    if status >= 400:
        assert response.json()["detail"], "every refusal says why"
        assert manager.buffers() == before


def test_admission_what_if_answers_why_and_changes_nothing(manager: ManagerClient) -> None:
    for g in ("a", "b", "c", "d"):
        manager.reserve(g, 0)
    before = (manager.buffers(), manager.events())
    fits = manager.http.get("/v1/admission", params={"version": 0}).json()
    assert fits["admissible"] == {"0": 0}
    what_if = fits["what_if"]
    assert what_if["count"] == 1 and not what_if["admissible"] and what_if["room"] == 0
    assert what_if["full_buffers"] == [0, 1] and what_if["consume_through"] == 0 and what_if["then_version"] == 1
    assert "consume buffer 0 first" in what_if["reason"]
    assert manager.http.get("/v1/admission").json()["what_if"] is None, "only asked for"
    assert (manager.buffers(), manager.events()) == before, "a what-if never changes the ledger"
    for g in ("a", "b"):
        manager.occupy(g)
    manager.consume()
    now = manager.http.get("/v1/admission", params={"version": 1, "count": 2}).json()["what_if"]
    assert now["admissible"] and now["room"] == 2 and now["then_version"] is None
    manager.reserve("e", 1)  # the answer held: two groups of version 1 fit
    manager.reserve("f", 1)


def test_consume_refusal_reports_the_buffer_state(manager: ManagerClient) -> None:
    manager.reserve("a", 0)
    manager.reserve("b", 0)
    manager.occupy("a")
    with pytest.raises(ServiceError) as err:
        manager.consume()
    assert err.value.status == 409
    assert err.value.body["state"] in ("waiting", "stuck") and err.value.body["occupied"] == 1


def test_consume_naming_its_buffer_is_exactly_once_under_retries(manager: ManagerClient) -> None:
    for g in ("a", "b"):
        manager.reserve(g, 0)
        manager.occupy(g)
    with pytest.raises(ServiceError) as early:
        manager.consume(1)  # not the head: refused, nothing consumed
    assert early.value.status == 409 and early.value.body["code"] == "not_next"
    first = manager.consume(0)
    assert first.replayed is False and sorted(first.group_ids) == ["a", "b"]
    retry = manager.consume(0)  # the reply was lost; the trainer asks again
    assert retry.replayed is True and sorted(retry.group_ids) == ["a", "b"]
    assert manager.buffers().train_version == 1
    assert [e["op"] for e in manager.events().events].count("consume") == 1


def test_metrics_are_prometheus_text(manager: ManagerClient) -> None:
    manager.reserve("a", 0)
    manager.occupy("a")
    manager.reserve("b", 0)
    text = manager.http.get("/metrics").text
    assert "staleflow_ledger_admitted_total 2.0" in text
    assert "staleflow_ledger_occupied_total 1.0" in text
    assert 'staleflow_ledger_entries{status="reserved"} 1.0' in text
    assert 'staleflow_ledger_buffers{state="waiting"}' in text


def test_state_survives_a_restart_on_the_same_database(tmp_path: Path, db_url: str | None) -> None:
    config = manager_config(tmp_path, db_url)
    with serve_in_thread(create_app(config)) as server, ManagerClient(server.url) as client:
        client.reserve("a", 0)
        client.reserve("b", 0)
        client.occupy("a")
        client.occupy("b")
        client.consume()
        client.reserve("c", 1)
        before = client.buffers()
    with serve_in_thread(create_app(config)) as server, ManagerClient(server.url) as client:
        assert client.buffers() == before
        assert "staleflow_ledger_consumed_groups_total 2.0" in client.http.get("/metrics").text
        with pytest.raises(ServiceError) as dup:
            client.reserve("a", 1)  # ids stay single-use across restarts
        assert dup.value.status == 409


def test_reopening_with_other_settings_is_refused(tmp_path: Path, db_url: str | None) -> None:
    config = manager_config(tmp_path, db_url)
    DurableLedger.open(config.database_url(), config.ledger.params()).close()
    other = manager_config(tmp_path, db_url, eta=3)
    with pytest.raises(SettingsMismatch, match=r"eta=1 \(asked 3\).*pass the same settings"):
        DurableLedger.open(other.database_url(), other.ledger.params())
