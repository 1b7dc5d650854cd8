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
