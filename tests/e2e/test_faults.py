"""Fault injection on loopback: each role killed once during a running job (--processes), only
that role restarts, and the job finishes with nothing lost, nothing consumed twice, every
consumed trajectory within eta, the trainer's version monotone and the PS serving a complete
version."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow.config import JobConfig, LedgerConfig
from staleflow.launch.faults import FaultRun, summarize


@pytest.mark.timeout(300)
def test_every_role_killed_once_the_job_finishes_intact(tmp_path: Path) -> None:
    config = JobConfig(engine="sim", workload="ci-tiny", max_tokens=48, instances=3, speed=8.0, steps=60,
                       ledger=LedgerConfig(eta=1, batch_size=4, group_size=2), state_dir=tmp_path / "run")
    roles = ["instance", "ts", "params", "manager", "coordinator", "trainer", "instance"]
    result = FaultRun(config, roles, every=2, hang_instance=True, deadline_s=240).run()
    assert result.violations == [], result.violations
    assert [f.role for f in result.faults] == roles, "every fault was injected"
    assert result.faults[-1].how == "hang" and "coordinator" in result.faults[-1].detected_by
    for f in result.faults:
        assert f.detection_s is not None and f.recovery_s is not None, f
        assert f.recovered_at is not None
    # only the failed role restarted, once each
    assert sum(result.restarts.values()) == len(roles)
    assert result.checks["groups_consumed_twice"] == 0 and result.checks["lost_trajectories"] == 0
    report = summarize(None, result)
    assert set(report["per_role"]) == {"instance", "instance (hung)", "ts", "params", "manager", "coordinator",
                                       "trainer"}
    assert report["ettr"] is not None and 0 < report["ettr"] <= 1


@pytest.mark.timeout(400)
def test_instances_killed_mid_long_responses_with_checkpoints_the_job_finishes_intact(tmp_path: Path) -> None:
    """Progress checkpoints every 32 tokens of demo-length responses: trajectories of the killed
    and the hung instance resume from their checkpoints, and the run keeps every guarantee."""
    config = JobConfig(engine="sim", workload="demo", max_tokens=1024, instances=2, speed=4.0, steps=8,
                       ledger=LedgerConfig(eta=2, batch_size=2, group_size=2), state_dir=tmp_path / "run",
                       instance={"progress_tokens": 32})
    result = FaultRun(config, ["instance", "instance"], every=2, hang_instance=True, deadline_s=300).run()
    assert result.violations == [], result.violations
    assert result.checks["groups_consumed_twice"] == 0 and result.checks["lost_trajectories"] == 0
    hit = [f for f in result.faults if f.regenerated_tokens]
    assert hit, "an instance fault hit running trajectories"
    assert all(f.checkpoint_round_s is not None and f.since_checkpoint_round_s is not None for f in hit), \
        "the instances were checkpointing"
    summary = summarize(None, result)
    report = summary["regenerated_tokens"]
    assert report["trajectories"] == sum(len(f.regenerated_tokens) for f in result.faults) > 0
    # the trajectory server counts from the coordinator's last snapshot of each failed instance (at most a
    # cycle old) what the harness measured just before the fault: the two agree within one cycle's tokens
    counted = report["counted_by_trajectory_server"]["total"]
    one_cycle = report["counted_by_trajectory_server"]["one_cycle_tokens"]
    assert counted is not None and one_cycle is not None
    assert abs(counted - report["total"]) <= one_cycle, report
    skew = summary["length_skew"]
    assert sum(skew["trained"].values()) == 8 * 2 * 2, "every trained trajectory is in the length-skew accounting"
    assert sum(skew["regenerated_tokens"].values()) == counted
