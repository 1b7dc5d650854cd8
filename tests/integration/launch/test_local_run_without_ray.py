"""A run on one machine never loads Ray: the Ray launcher is imported only for `--launcher ray`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RUN_AND_LIST_RAY_MODULES = """
import json, sys
from staleflow.cli.main import app
try:
    app(sys.argv[1:], standalone_mode=False)
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.") or m.startswith("staleflow.launch.ray"))))
"""


def test_a_default_sim_up_does_not_import_ray(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST_RAY_MODULES, "up", "--engine", "sim", "--steps", "2", "--workload", "ci-tiny",
         "--instances", "2", "--batch-size", "4", "--group-size", "2", "--eta", "1", "--max-tokens", "48",
         "--speed", "20", "--state-dir", str(tmp_path / "run"), "--json-log"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-2])["event"] == "end" and json.loads(lines[-2])["completed"]
    assert json.loads(lines[-1]) == [], "a local run imported Ray"
