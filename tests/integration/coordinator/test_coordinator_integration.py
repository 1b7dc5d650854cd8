"""The coordinator driving sim instances over HTTP; one instance dies mid-run."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack
from pathlib import Path

from support import free_port, manager_and_trajectory_server, start_cli

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.api.manager import ManagerClient
from staleflow.api.trajectories import BatchOut, TrajectoryClient
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import serve_in_thread

ETA, BATCH, GROUP, STEPS = 1, 4, 2, 8


def test_training_completes_within_the_bound_when_an_instance_dies(tmp_path: Path) -> None:
    with ExitStack() as stack:
        manager_url, ts_url = manager_and_trajectory_server(stack, tmp_path, 48, eta=ETA, batch_size=BATCH,
                                                            group_size=GROUP)
        instances = {}
        for name in ("a", "b", "c"):  # separate processes, so one can die for real (SIGKILL)
            port = free_port()
            proc = start_cli("serve", "instance", "--engine", "sim", "--instance-id", name, "--port", str(port),
                             "--clock", "real", "--speed", "20", "--workload", "ci-tiny",
                             "--callback-url", TrajectoryClient.completed.url(ts_url), "--log-level", "warning")
            stack.callback(proc.wait, 10)
            stack.callback(proc.kill)
            instances[name] = (proc, f"http://127.0.0.1:{port}")
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager_url, ts_url=ts_url, cycle_period=0.02, failure_timeout=3.0,
            instances=[InstanceEndpoint(instance_id=n, url=url) for n, (_, url) in instances.items()]))))
        manager = stack.enter_context(ManagerClient(manager_url))
        ts = stack.enter_context(TrajectoryClient(ts_url))
        co = stack.enter_context(CoordinatorClient(coordinator.url))
        consumed: dict[str, int] = {}
        batches: list[BatchOut] = []
        victim, stranded, detected_at = None, [], None
        deadline = time.monotonic() + 90
        # train until the failure is detected, then eta + 2 more steps: by then the ledger has
        # forced every group the dead instance held into a consumed buffer
        while len(batches) < STEPS or detected_at is None or len(batches) < detected_at + ETA + 2:
            assert time.monotonic() < deadline, f"training stalled after {len(batches)} steps"
            try:
                step = manager.consume()
            except ServiceError:
                time.sleep(0.02)  # the trainer polls for a Ready buffer
                continue
            assert step.version is not None
            batches.append(ts.batch(step.version))
            ts.free_batch(step.version)
            for g in step.group_ids:
                assert g not in consumed, "a group was consumed twice"
                consumed[g] = step.version
            if victim is None and len(batches) >= 2:
                # kill the instance holding the most unfinished work, while it holds it
                routed = [t for t in ts.routed().trajectories if t.state == "routed"]
                holders = [t.instance_id for t in routed]
                if holders and max(map(holders.count, set(holders))) >= 3:
                    candidate = max(set(holders), key=holders.count)
                    proc = instances[candidate][0]
                    proc.send_signal(signal.SIGSTOP)  # frozen: what it holds now is what the kill loses
                    held = [t.traj_id for t in ts.routed(instance_id=candidate).trajectories]
                    if len(held) >= 3:  # so the kill strands work even if one completion was already on its way
                        victim, stranded = candidate, held
                        proc.send_signal(signal.SIGKILL)
                        proc.wait()
                    else:  # it finished most of it in the meantime: let it go on, pick again later
                        proc.send_signal(signal.SIGCONT)
            if victim and detected_at is None and co.stats().failures:
                detected_at = len(batches)

        for batch in batches:
            version = batch.version
            assert len(batch.trajectories) == BATCH * GROUP, "every group arrives whole"
            for t in batch.trajectories:
                assert t.v_traj is not None and t.v_traj <= version <= t.v_traj + ETA, "staleness bound"
                assert len(t.tokens) == len(t.logprobs) > 0
                assert t.segments[0].version >= t.v_traj, "no token older than V_traj"
        assert victim is not None, "no instance ever held work"
        status = {i.instance_id: i.status for i in co.instances().instances}
        assert status[victim] == "failed"
        assert all(s != "failed" for name, s in status.items() if name != victim)
        moved = []
        for traj_id in stranded:  # the dead instance's work was trained on
            final = ts.trajectory(traj_id)
            assert final.state in ("consumed", "aborted")
            assert traj_id.rsplit("-m", 1)[0] in consumed, f"{traj_id}'s group never reached the trainer"
            if final.instance_id != victim:  # not finished there before it died (callback in flight)
                moved.append(traj_id)
        assert moved, "the kill stranded unfinished work"
        assert not ts.routed(instance_id=victim).trajectories
        stats = co.stats()
        # what the coordinator released is what was still routed there when it declared the failure:
        # partials of an interrupt the instance answered just before it froze may have gone back already
        assert stats.failures == 1 and stats.released <= len(stranded)
        assert stats.routed > 0 and stats.accepted_snapshots > 0
        assert co.commands(limit=5).commands
