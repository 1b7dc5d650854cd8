"""`pip install '.[ray]'` as a user does it (a wheel, not the editable checkout) runs the sim job on
a local three-node Ray cluster to completion: the cluster's workers import StaleFlow from the
wheel, so a module missing from it would fail here.

The cluster and the driver run in a process of the wheel's environment, inside a loopback-only
network namespace (``unshare -n`` as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the Ray launcher's tests need Ray (the [ray] extra)")

pytestmark = [pytest.mark.ray, pytest.mark.slow]


CLUSTER_AND_JOB = textwrap.dedent('''
    import json, os, subprocess, sys
    import staleflow
    from ray.cluster_utils import Cluster

    state, steps = sys.argv[1], sys.argv[2]
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "num_cpus": 0, "include_dashboard": False})
    try:
        cluster.add_node(**node, num_cpus=1, resources={"staleflow_control": 1}, labels={"staleflow.io/role": "control"})
        cluster.add_node(**node, num_cpus=2, num_gpus=4, resources={"staleflow_rollout": 1, "staleflow_trainer": 1},
                         labels={"staleflow.io/role": "rollout"})
        cluster.wait_for_nodes()
        job = subprocess.run([os.path.join(os.path.dirname(sys.executable), "staleflow"), "up", "--launcher", "ray",
                              "--ray-address", cluster.address, "--engine", "sim", "--steps", steps,
                              "--state-dir", state, "--workload", "ci-tiny", "--max-tokens", "48", "--instances", "2",
                              "--batch-size", "4", "--group-size", "2", "--eta", "1", "--speed", "20", "--json-log",
                              "--config", os.path.join(state + ".yaml")], capture_output=True, text=True, timeout=400)
        print(json.dumps({"staleflow": staleflow.__file__, "returncode": job.returncode,
                          "stdout": job.stdout[-3000:], "stderr": job.stderr[-3000:]}))
    finally:
        cluster.shutdown()
''')


@pytest.mark.timeout(900)
def test_a_wheel_install_runs_the_sim_job_on_a_local_ray_cluster(installed_wheel: tuple[Path, str],
                                                                 tmp_path: Path) -> None:
    python, site = installed_wheel

    state = tmp_path / "run"
    # the rollout node carries a role label of its own: select rollout and trainer nodes by resource
    Path(f"{state}.yaml").write_text(json.dumps({"cluster": {"trainer": {"resource": "staleflow_trainer", "labels": {}}}}))
    script = tmp_path / "cluster_and_job.py"
    script.write_text(CLUSTER_AND_JOB)
    command = [str(python), str(script), str(state), "3"]
    if os.geteuid() == 0 and shutil.which("unshare"):
        command = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")} | {"RAY_USAGE_STATS_ENABLED": "0"}
    ran = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=800)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert result["staleflow"].startswith(site), "the cluster ran the wheel's StaleFlow"
    assert result["returncode"] == 0, result["stdout"] + result["stderr"]
    end = [json.loads(line) for line in result["stdout"].splitlines() if line.startswith("{")][-1]
    assert end["event"] == "end" and end["completed"] and end["staleness_violations"] == 0
    assert json.loads((state / "endpoints.json").read_text())["launcher"] == "ray"
