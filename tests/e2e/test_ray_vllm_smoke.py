"""A real-engine smoke of `staleflow up --launcher ray`: one vLLM instance on a rollout node holding a
fake GPU, two gloo trainer ranks (FSDP2 on CPU) on two trainer nodes, the demo model, three steps;
the follower rank is SIGKILLed after the first step, and the gang restarts from the checkpoint.

The cluster (a head with no CPUs, a control node, a rollout node, two trainer nodes) is selected by
the default `cluster:` section: custom resources and `staleflow.io/role` labels together. It runs in
a loopback-only network namespace, every Ray process bound to 127.0.0.1, so the trainer's
rendezvous (MASTER_ADDR from a probe on the first trainer node) is loopback here; on a real cluster
it is the first trainer node's IP. CPU-heavy (vLLM on CPU beside two FSDP ranks): run it alone:

    pytest -m 'ray and vllm' tests/e2e/test_ray_vllm_smoke.py -s
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray", reason="the Ray launcher's tests need Ray (the [ray] extra)")
pytest.importorskip("vllm", reason="the real-engine smoke needs vLLM (the vllm extra)")
pytest.importorskip("transformers", reason="the real-engine smoke needs the trainer (the train extra)")

from support.ray_cluster import NODE, descendants, loopback_only_network, still_running, wait_for  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.torch, pytest.mark.slow, pytest.mark.smoke]


def role(name: str, **resources: float) -> dict:
    return {"resources": {f"staleflow_{name}": 1}, "labels": {"staleflow.io/role": name}, **resources}


@pytest.mark.timeout(1800)
def test_vllm_instance_and_two_gloo_ranks_on_two_nodes_train_two_steps(tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    with loopback_only_network():
        cluster = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 0, "include_dashboard": False})
        ran: list[int] = []
        try:
            cluster.add_node(**NODE, num_cpus=1, **role("control"))
            cluster.add_node(**NODE, num_cpus=2, num_gpus=1, **role("rollout"))
            trainer_nodes = [cluster.add_node(**NODE, num_cpus=1, **role("trainer")) for _ in range(2)]
            cluster.wait_for_nodes()
            config = tmp_path / "smoke.yaml"
            config.write_text(yaml.safe_dump({
                "engine": "vllm", "steps": 3, "instances": 1, "trainer": {"world_size": 2, "checkpoint_every": 1},
                "ledger": {"eta": 1, "batch_size": 2, "group_size": 2},
                "cluster": {"address": cluster.address, "namespace": "staleflow-vllm-smoke", "trainer_nodes": 2,
                            "gpus_per_rank": 0, "cpus_per_rank": 0.5, "gpus_per_instance": 1,
                            "cpus_per_instance": 1}}))
            state = tmp_path / "state"
            up = subprocess.Popen([sys.executable, "-m", "staleflow.cli", "up", "--launcher", "ray", "--config",
                                   str(config), "--state-dir", str(state), "--json-log"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
            output: list[str] = []
            threading.Thread(target=lambda: output.extend(up.stdout), daemon=True).start()  # type: ignore[arg-type]
            step_log = state / "trainer" / "steps.jsonl"
            # one rank of the gang dies after the first step: both restart from the newest checkpoint
            wait_for(lambda: step_log.exists() and step_log.read_text().strip() or up.poll() is not None, 1500,
                     "the first step trained")
            assert up.poll() is None, "".join(output[-60:])
            follower = json.loads((state / "placement.json").read_text())["trainer-1"]["pid"]
            os.kill(follower, signal.SIGKILL)
            up.wait(1500)
            text = "".join(output)
            print(text[-4000:])
            events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            end = next((e for e in events if e["event"] == "end"), None)
            assert up.returncode == 0 and end is not None and end["completed"], text[-4000:]
            assert end["staleness_violations"] == 0
            versions = [json.loads(line)["version"] for line in step_log.read_text().splitlines()]
            # a step the killed gang trained after its newest checkpoint is trained again
            assert sorted(set(versions)) == [0, 1, 2] and len(versions) <= 4, f"each version trained: {versions}"
            assert json.loads((state / "placement.json").read_text())["trainer-1"]["pid"] != follower
            ranks = sorted((tmp_path / "state" / "logs").glob("trainer-*.log"))
            assert [p.name for p in ranks] == ["trainer-0.log", "trainer-1.log"]
            placement = json.loads((tmp_path / "state" / "placement.json").read_text())
            assert {placement["trainer-0"]["node_id"], placement["trainer-1"]["node_id"]} == \
                {n.node_id for n in trainer_nodes}, "one rank on each trainer node"
            assert placement["inst-0"]["gpu_ids"] == ["0"]
        finally:
            ran = descendants(os.getpid())
            with contextlib.suppress(Exception):
                ray.shutdown()
            cluster.shutdown()
        wait_for(lambda: not still_running(ran), 30, "every process of the cluster exits")
