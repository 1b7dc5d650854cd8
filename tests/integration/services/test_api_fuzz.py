"""Schemathesis fuzzes every service's OpenAPI schema over loopback: no 5xx, every answer (errors
included: ``{"detail", "code", ...}``) conforms to the schema, state intact."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from support import manager_config

from staleflow.config import LedgerConfig
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.errors import ErrorCode
from staleflow.ledger import Ledger
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.params import ParamsConfig
from staleflow.servers.params import create_app as params_app
from staleflow.servers.reward import RewardConfig
from staleflow.servers.reward import create_app as reward_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

CONTRACT = [  # what every answer must satisfy
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.response_schema_conformance,
    schemathesis.checks.content_type_conformance,
]
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    with ExitStack() as stack:
        manager = stack.enter_context(serve_in_thread(manager_app(
            # NORMAL: fsync per commit is what the crash tests check; here it would only slow the fuzzing
            manager_config(tmp, eta=2, batch_size=3).model_copy(update={"synchronous": "NORMAL"}))))
        ts = stack.enter_context(serve_in_thread(ts_app(TrajectoryServerConfig(
            ledger=LedgerConfig(eta=2, batch_size=3, group_size=1), manager_url=manager.url, state_dir=tmp,
            reward="sim", sampling=SamplingConfig(max_tokens=16)))))
        # the fuzzed instance stands alone; the coordinator drives another one
        instance = stack.enter_context(serve_in_thread(instance_app(InstanceConfig(
            instance_id="fuzz", sim=SimConfig(workload="ci-tiny")))))
        driven = stack.enter_context(serve_in_thread(instance_app(InstanceConfig(
            instance_id="driven", sim=SimConfig(workload="ci-tiny")))))
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager.url, ts_url=ts.url, cycle_period=0.05,
            instances=[InstanceEndpoint(instance_id="driven", url=driven.url)]))))
        params = stack.enter_context(serve_in_thread(params_app(ParamsConfig(
            state_dir=tmp / "params", chunk_bytes=1 << 16, fsync=False))))
        reward = stack.enter_context(serve_in_thread(reward_app(RewardConfig(workers=1, timeout_s=2))))
        yield {"manager": manager, "ts": ts, "instance": instance, "coordinator": coordinator, "params": params,
               "reward": reward}


def fuzz_service(url: str) -> int:
    """Every operation of the service's schema, fuzzed with schemathesis' Hypothesis strategies."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:

        @FUZZ
        @given(case=operation.as_strategy())
        def answers_by_the_contract(case) -> None:
            for part in (case.query, case.body):
                if isinstance(part, dict) and "wait_s" in part:
                    part["wait_s"] = 0  # long polls are tested elsewhere; here only answers count
            response = case.call(base_url=url, timeout=30)
            case.validate_response(response, checks=CONTRACT)
            if response.status_code >= 400:
                body = response.json()
                assert isinstance(body.get("detail"), str) and ErrorCode.parse(body.get("code")) is not None, body

        answers_by_the_contract()
    return len(operations)


@pytest.mark.parametrize("name", ["manager", "ts", "instance", "coordinator", "params", "reward"])
def test_every_answer_conforms_to_the_schema(services: dict, name: str) -> None:
    assert fuzz_service(services[name].url) >= 3


def test_ledger_invariants_hold_after_fuzzing(services: dict) -> None:
    """Runs after the fuzzers (file order): whatever they did, the durable state is consistent."""
    import httpx

    state = httpx.get(f"{services['manager'].url}/v1/buffers").json()
    eta, t = state["eta"], state["train_version"]
    seen = set()
    for b in state["buffers"]:
        assert len(b["entries"]) <= b["capacity"]
        for e in b["entries"]:
            assert e["v_traj"] <= b["version"] <= e["v_traj"] + eta and e["v_traj"] <= t
            assert e["group_id"] not in seen
            seen.add(e["group_id"])
    # the same state, reloaded from disk by the pure ledger, agrees with what the server shows
    from staleflow.servers.manager.store import DurableLedger

    ledger: Ledger = services["manager"].server.config.app.state.manager.ledger.ledger
    assert [b.version for b in ledger.buffers()] == [b["version"] for b in state["buffers"]]
    assert isinstance(services["manager"].server.config.app.state.manager.ledger, DurableLedger)
