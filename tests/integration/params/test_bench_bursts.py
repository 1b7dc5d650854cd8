"""``staleflow bench params --sources``: bursts of instances pulling one version at once from a
parameter server whose egress is limited, per source, with every instance's bytes verified."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.transports import burst_ros  # noqa: F401 - registers the ros source, as the CLI does
from staleflow.transports.burst import (
    BURST,
    BURST_SOURCES,
    ELASTIC_JOIN,
    HOLDER_KILLED,
    BurstSource,
    register_burst_source,
)


@pytest.mark.slow  # spawns a PS and three instance processes per source
@pytest.mark.parametrize("source", sorted(BURST_SOURCES))
def test_a_burst_run_reports_each_count_an_elastic_join_and_a_killed_holder_or_why_not(tmp_path: Path, source: str) -> None:
    output, plot = tmp_path / "bursts.json", tmp_path / "bursts.png"
    result = CliRunner().invoke(app, ["bench", "params", "--sources", source, "--sizes", "4MB", "--instances", "1,2",
                                      "--repeats", "1", "--chunk-mb", "1", "--link-gbps", "2", "--output", str(output),
                                      "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    data = json.loads(output.read_text())
    assert data["mode"] == "burst" and data["link_gbps"] == 2 and data["sources"] == [source]
    assert data["ps_egress_gbps"] == 2, "the PS process applies the link"
    cells = {(c["kind"], c["instances"]): c for c in data["cells"]}
    runs_kill = HOLDER_KILLED in BURST_SOURCES[source].cases
    assert set(cells) == {(BURST, 1), (BURST, 2), (ELASTIC_JOIN, 2)} | ({(HOLDER_KILLED, 2)} if runs_kill else set())
    for cell in cells.values():
        assert cell["source"] == source and cell["verified"] and cell["burst_seconds"] > 0
        assert cell["pull_seconds_mean"] <= cell["burst_seconds"] and cell["vs_wire_time"] > 0
    assert cells[BURST, 1]["vs_single"] == 1.0
    join = cells[ELASTIC_JOIN, 2]
    assert 0 < join["join_seconds"] and join["join_after_s"] == pytest.approx(0.5 * cells[BURST, 1]["burst_seconds"])
    if not runs_kill:
        (skipped,) = data["skipped"]
        assert skipped["kind"] == HOLDER_KILLED and skipped["why"]
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--sources", "carrier-pigeon"], "unknown source 'carrier-pigeon'"),
    (["--sources", ""], "at least one source"),
    (["--sources", "ps", "--sizes", "1MB,2MB"], "one version size at a time"),
    (["--sources", "ps", "--link-gbps", "0"], "positive speed"),
])
def test_bad_burst_options_say_what_to_fix(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["bench", "params", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_the_registry_refuses_a_second_source_of_one_name_and_one_without_bursts() -> None:
    assert {"ps", "ros"} <= set(BURST_SOURCES)

    def never(_):  # pragma: no cover - never opened
        return contextlib.nullcontext()

    with pytest.raises(ValueError, match="registered already"):
        register_burst_source(BurstSource("ps", "again", never))
    with pytest.raises(ValueError, match="cases must include"):
        register_burst_source(BurstSource("joins-only", "no bursts", never, cases=frozenset({ELASTIC_JOIN})))
    assert "joins-only" not in BURST_SOURCES
