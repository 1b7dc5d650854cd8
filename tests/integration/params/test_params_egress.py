"""A parameter server with an egress limit (``egress_gbps``) sends every chunk body through its one
limiter, on the data plane and on the API port alike, and the bytes arrive whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_params_server import assert_same, config, state_dict

from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import create_app
from staleflow.transports.client import ParamsClient


@pytest.mark.parametrize("data_port", [0, None], ids=["data-plane", "api-port"])
def test_every_chunk_body_a_pull_takes_goes_through_the_endpoints_limiter(tmp_path: Path, data_port: int | None) -> None:
    app = create_app(config(tmp_path, egress_gbps=100.0, data_port=data_port))
    with serve_in_thread(app) as server, ParamsClient(server.url) as client:
        pushed = state_dict(3)
        client.push(3, pushed, transport="http")  # chunk bodies coming in are not egress
        assert app.state.egress.bucket.granted == 0
        manifest = client.manifest(3)
        data_bytes = sum(chunk.length for chunk in manifest.chunks)
        assert len(manifest.chunks) > 1
        assert_same(client.pull(3, "http", verify="checksum"), pushed)
        assert app.state.egress.bucket.granted == data_bytes
        assert_same(client.pull(3, "http"), pushed)
        assert app.state.egress.bucket.granted == 2 * data_bytes
        assert client.health().egress_gbps == 100.0


def test_without_a_limit_the_server_has_no_limiter(tmp_path: Path) -> None:
    app = create_app(config(tmp_path))
    with serve_in_thread(app) as server, ParamsClient(server.url) as client:
        client.push(1, state_dict(1), transport="http")
        assert_same(client.pull(1, "http"), state_dict(1))
        assert app.state.egress is None and client.health().egress_gbps is None


def test_a_limit_must_be_positive(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="egress_gbps"):
        config(tmp_path, egress_gbps=0)
