"""Chaos: the job's PostgreSQL server stops for 60 s in the middle of a job. The job pauses (the
trajectory server says it is degraded, waiting for its database, and is not restarted), resumes by
itself once the server is back, and finishes with every trajectory accounted for and the bound held."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from support import group_state

from staleflow.config.manager import LedgerParams
from staleflow.servers.manager.store import DurableLedger
from staleflow.servers.trajectories.store import TrajectoryStore

OUTAGE_S = 60.0
STEPS = 8
LEDGER = {"eta": 1, "batch_size": 4, "group_size": 2}




def _events(proc: subprocess.Popen) -> Iterator[dict]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)


@pytest.mark.postgres
@pytest.mark.timeout(600)
def test_a_database_outage_pauses_the_job_which_then_finishes_with_nothing_lost(tmp_path: Path, own_postgres) -> None:
    url = own_postgres.create_database()
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"engine": "sim", "workload": "ci-tiny", "max_tokens": 48, "instances": 2,
                                   "speed": 20, "ledger": LEDGER, "db_url": url}))
    state = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "staleflow.cli", "up", "--config", str(job), "--steps", str(STEPS),
                             "--state-dir", str(state), "--json-log"], stdout=subprocess.PIPE, text=True)
    try:
        events = _events(proc)
        urls = {}
        for event in events:
            urls.update({event["name"]: event["url"]} if event["event"] == "component" else {})
            if event["event"] == "sample" and event["train_version"] >= 2:
                break
        own_postgres.halt()
        halted = time.monotonic()
        degraded = None
        with httpx.Client(timeout=5, headers={"Authorization": f"Bearer {(state / 'token').read_text().strip()}"}) as c:
            while time.monotonic() - halted < OUTAGE_S:  # the outage lasts this long; the job must outlive it
                assert proc.poll() is None, "the job ended during the outage"
                health = c.get(f"{urls['ts']}/v1/health")
                assert health.status_code == 200, health.text  # up, not down
                if health.json()["status"] == "degraded":
                    degraded = health.json()["dependencies"]
                time.sleep(1.0)  # the outage's pacing, not synchronisation
        assert degraded is not None and "database" in degraded, "health said which dependency is down"
        own_postgres.resume()
        for event in events:
            if event["event"] == "end":
                end = event
                break
        assert proc.wait(120) == 0, end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert end["completed"] and end["staleness_violations"] == 0, end
    summary = json.loads((state / "report" / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert not [r for r in summary["restarts"] if r["component"] == "ts"], "the degraded server was not restarted"
    ledger = DurableLedger.open(url, LedgerParams(**LEDGER))
    store = TrajectoryStore.open(url)
    try:
        assert ledger.train_version == STEPS
        seen: set[str] = set()
        for version in range(STEPS):
            groups = ledger.consumed_batch(version)
            assert len(groups) == LEDGER["batch_size"], f"buffer {version} is not whole"
            assert seen.isdisjoint(groups), "a group was consumed twice"
            seen.update(groups)
        for g in seen:  # every trajectory of every consumed group reached the trainer
            assert group_state(store, g)[1] == ["consumed"] * LEDGER["group_size"], g
    finally:
        store.close()
        ledger.close()
