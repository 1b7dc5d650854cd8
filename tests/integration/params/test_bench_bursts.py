"""``staleflow bench params --sources``: bursts of instances pulling one version at once from a
parameter server whose egress is limited, per source, with every instance's bytes verified."""

from __future__ import annotations

import contextlib
import json
import statistics
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
    PUSH_DURING_JOIN,
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
    (push,) = data["pushes"]
    assert push["source"] == source and push["instances"] == 2 and push["push_ratio"] > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("source", sorted(BURST_SOURCES))
def test_the_push_during_a_join_reports_push_seconds_alone_and_during_it(tmp_path: Path, source: str) -> None:
    """The trainer's push of a new version, alone and while one more instance pulls the previous
    one: both push times, their ratio, the joiner's pull, on a tiny version."""
    output = tmp_path / "pushes.json"
    result = CliRunner().invoke(app, ["bench", "params", "--sources", source, "--sizes", "2MB", "--instances", "1",
                                      "--repeats", "2", "--chunk-mb", "1", "--link-gbps", "1", "--cases",
                                      PUSH_DURING_JOIN, "--output", str(output)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "during / alone" in result.output
    data = json.loads(output.read_text())
    assert data["cases"] == [PUSH_DURING_JOIN] and data["cells"] == [] and data["skipped"] == []
    (push,) = data["pushes"]
    assert push["source"] == source and push["kind"] == PUSH_DURING_JOIN and push["instances"] == 1
    assert push["runs"] == 2 and push["push_transport"] == "http" and push["verified"]
    assert len(push["push_seconds_all"]) == len(push["push_seconds_with_join_all"]) == 2
    assert push["push_seconds"] == pytest.approx(statistics.median(push["push_seconds_all"]))
    assert push["push_seconds_with_join"] == pytest.approx(statistics.median(push["push_seconds_with_join_all"]))
    assert min(push["push_seconds_all"] + push["push_seconds_with_join_all"]) > 0
    assert push["push_ratio"] == pytest.approx(push["push_seconds_with_join"] / push["push_seconds"])
    assert push["join_seconds"] > 0 and 0 <= push["join_overlap"] <= 1


@pytest.mark.parametrize("args, message", [
    (["--sources", "carrier-pigeon"], "unknown source 'carrier-pigeon'"),
    (["--sources", ""], "at least one source"),
    (["--sources", "ps", "--sizes", "1MB,2MB"], "one version size at a time"),
    (["--sources", "ps", "--link-gbps", "0"], "positive speed"),
    (["--sources", "ps", "--cases", "burst,teleport"], "choose from burst, elastic_join"),
    (["--sources", "ps", "--cases", "push_during_join", "--plot", "x.png"], "add burst to --cases"),
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
