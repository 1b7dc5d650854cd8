"""Every route a service serves is declared once in ``staleflow.api``, and served. Every operation
of every service declares what its success answers: a JSON schema that names
its fields, or a binary body (``application/octet-stream``). The OpenAPI schema is then the
contract the fuzz test (test_api_fuzz.py) checks the answers against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from support import manager_config

from staleflow.api.base import Route
from staleflow.api.coordinator import CoordinatorRoutes
from staleflow.api.instance import InstanceRoutes
from staleflow.api.manager import ManagerRoutes
from staleflow.api.params import ParamsRoutes
from staleflow.api.reward import RewardRoutes
from staleflow.api.trajectories import TrajectoryRoutes
from staleflow.config import LedgerConfig
from staleflow.coordinator.app import CoordinatorConfig
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.params import ParamsConfig
from staleflow.servers.params import create_app as params_app
from staleflow.servers.reward import RewardConfig
from staleflow.servers.reward import create_app as reward_app
from staleflow.servers.trajectories import TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

UNREACHABLE = "http://127.0.0.1:9"  # the apps are built, never served: nothing is called


def services(tmp: Path) -> dict[str, FastAPI]:
    return {
        "manager": manager_app(manager_config(tmp)),
        "trajectories": ts_app(TrajectoryServerConfig(ledger=LedgerConfig(), manager_url=UNREACHABLE, state_dir=tmp,
                                                      reward="sim")),
        "instance": instance_app(InstanceConfig(instance_id="typed", sim=SimConfig(workload="ci-tiny"))),
        "coordinator": coordinator_app(CoordinatorConfig(manager_url=UNREACHABLE, ts_url=UNREACHABLE)),
        "params": params_app(ParamsConfig(state_dir=tmp / "params")),
        "reward": reward_app(RewardConfig()),
    }


def untyped_parts(schema: dict, components: dict, seen: frozenset[str] = frozenset()) -> list[str]:
    """Where ``schema`` leaves a value's shape open: an empty schema, or an object whose values
    may be anything. A named model (``$ref``) is followed once."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return [] if name in seen else untyped_parts(components[name], components, seen | {name})
    for union in ("anyOf", "oneOf", "allOf"):
        if union in schema:
            return [part for option in schema[union] for part in untyped_parts(option, components, seen)]
    kind = schema.get("type")
    if kind is None and "const" not in schema and "enum" not in schema:
        return [f"an empty schema {schema}"]
    if kind == "array":
        return untyped_parts(schema.get("items", {}), components, seen)
    if kind == "object" and not schema.get("properties"):
        values = schema.get("additionalProperties")
        if not isinstance(values, dict):
            return [f"an object of anything {schema}"]
        return untyped_parts(values, components, seen)
    return []


def untyped_operations(app: FastAPI) -> list[str]:
    """The operations whose 2xx answers are undeclared, or declared without a shape."""
    spec = app.openapi()
    components = spec.get("components", {}).get("schemas", {})
    found = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            where = f"{method.upper()} {path}"
            success = {code: answer for code, answer in operation["responses"].items() if code.startswith("2")}
            if not success:
                found.append(f"{where}: no 2xx answer declared")
            for code, answer in success.items():
                content = answer.get("content", {})
                if "application/octet-stream" in content:
                    continue
                if "application/json" not in content:
                    found.append(f"{where} {code}: no JSON schema and no application/octet-stream body")
                    continue
                found += [f"{where} {code}: {part}" for part in untyped_parts(content["application/json"]["schema"], components)]
    return found


@pytest.mark.parametrize("name", ["manager", "trajectories", "instance", "coordinator", "params", "reward"])
def test_every_operation_declares_a_typed_success_answer(tmp_path: Path, name: str) -> None:
    assert untyped_operations(services(tmp_path)[name]) == []


def test_the_check_finds_a_bare_dict_and_an_undeclared_binary_body() -> None:
    app = FastAPI()

    @app.get("/bare", response_model=dict[str, Any])
    def bare() -> dict:
        return {}

    @app.get("/bytes", response_class=StreamingResponse)
    def raw() -> StreamingResponse:
        return StreamingResponse(iter([b""]))

    found = untyped_operations(app)
    assert any(f.startswith("GET /bare 200: an object of anything") for f in found), found
    assert any(f.startswith("GET /bytes 200") for f in found), found


ROUTES: dict[str, type] = {"manager": ManagerRoutes, "trajectories": TrajectoryRoutes, "instance": InstanceRoutes,
                           "coordinator": CoordinatorRoutes, "params": ParamsRoutes, "reward": RewardRoutes}
UNDECLARED = {"/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # FastAPI's and Prometheus'


def declared_routes(routes: type) -> dict[tuple[str, str], Any]:
    """(method, path) of each route a routes class declares -> its reply type."""
    return {(r.method, r.path): r.reply for cls in routes.__mro__ for r in vars(cls).values() if isinstance(r, Route)}


def served_routes(app: FastAPI) -> dict[tuple[str, str], Any]:
    """(method, path) of each route ``app`` serves -> its response model."""
    return {(method, route.path): route.response_model for route in app.routes
            if isinstance(route, APIRoute) and route.path not in UNDECLARED for method in route.methods}


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_every_declared_route_is_served_with_its_reply_type_and_every_served_route_declared(
        tmp_path: Path, name: str) -> None:
    served, declared = served_routes(services(tmp_path)[name]), declared_routes(ROUTES[name])
    assert set(served) - set(declared) == set(), "served without a declaration in staleflow.api"
    assert set(declared) - set(served) == set(), "declared in staleflow.api, never served"
    assert {where: served[where] for where in declared} == declared
