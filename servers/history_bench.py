"""Does a step's store work cost the run's history? (``python -m staleflow.servers.history_bench``)

Side by side in one process, so that the machine's load weighs on both alike: the trajectory
store and the durable ledger over a young run's database (a small archive, few retired groups)
and over an old run's (a large archive, written straight into the archive tables through SQLite),
the same working set in each, and the trajectory server's length-skew accounting as many steps
in (its totals, read by every health probe, and the step log's read). Every training step goes through the calls a step makes (the store's:
pending, routed, cancellations, reserve's version, checkout, progress, completed, rewarded,
occupy, consumed, batch, free, which archives; the ledger's: reserve, occupy, consume, the event
poll), alternating between the two stores; then each store is reopened on its database (a
restart). CPU time of the process (``time.process_time``, every thread), per call and per step,
large over small: a ratio near 1 says the cost does not grow with the history."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import insert

from staleflow.config.manager import LedgerParams
from staleflow.length_skew import LengthSkew
from staleflow.servers.manager.bench import _fill_and_drain
from staleflow.servers.manager.store import DurableLedger
from staleflow.servers.schema import ledger_events, ledger_retired, ts_groups_archive, ts_trajectories_archive
from staleflow.servers.trajectories.store import GroupState, TrajectoryStore, _pack_floats, _pack_ints
from staleflow.trajectory_book import ProgressCheckpoint

GROUPS, MEMBERS, TOKENS = 16, 8, 64  # a step of the default shape: 16 groups of 8, short responses


def _archive(store: TrajectoryStore, groups: int) -> None:
    """``groups`` finished groups of ``MEMBERS`` straight into the archive tables."""
    now, tokens, logprobs = time.time(), _pack_ints(range(16)), _pack_floats([-0.5] * 16)  # ~49 MB at 250,000
    for start in range(0, groups, 2_000):
        ids = range(start, min(groups, start + 2_000))
        with store.engine.begin() as conn:
            conn.execute(insert(ts_groups_archive), [
                {"group_id": f"old{i}", "prompt_index": i, "prompt_text": f"{i} + {i}", "answer": str(2 * i),
                 "prompt_ids": tokens, "members": MEMBERS, "needed": MEMBERS, "v_traj": i // GROUPS,
                 "state": GroupState.CONSUMED.value, "seq": i, "created_at": now, "archived_at": now} for i in ids])
            conn.execute(insert(ts_trajectories_archive), [
                {"traj_id": f"old{i}-m{m}", "group_id": f"old{i}", "state": "rewarded", "instance_id": "inst-0",
                 "tokens": tokens, "logprobs": logprobs, "segments": json.dumps([[i // GROUPS, 0, 16]]),
                 "finish_reason": "stop", "reward": 1.0, "reward_reason": "", "seq": i * MEMBERS + m,
                 "updated_at": now, "archived_at": now} for i in ids for m in range(MEMBERS)])


def _old_ledger(ledger: DurableLedger, groups: int, events: int) -> None:
    """``groups`` long-retired groups and ``events`` consume events of old steps (what compaction
    keeps of them), written directly."""
    with ledger.engine.begin() as conn:
        for start in range(0, groups, 5_000):
            conn.execute(insert(ledger_retired), [{"group_id": f"old{i}", "v_traj": 0, "fate": "consumed", "buffer": -10,
                                                   "retired_at": 0.0} for i in range(start, min(groups, start + 5_000))])
        conn.execute(insert(ledger_events), [{"at": 0.0, "op": "consume", "group_id": None, "buffer": -10,
                                              "detail": '{"cancelled": [], "consumed": []}'} for _ in range(events)])


def _timed(cpu: dict[str, list[float]], name: str, fn: Callable, *args):
    start = time.process_time()
    result = fn(*args)
    cpu[name].append(time.process_time() - start)
    return result


def _store_step(store: TrajectoryStore, step: int, cpu: dict[str, list[float]]) -> None:
    """One training step's calls on the trajectory store, each timed under its name."""
    rows = [(step * GROUPS + i, f"p{step}-{i}", "0", tuple(range(16))) for i in range(GROUPS)]
    groups = _timed(cpu, "refill", store.add_groups, rows, MEMBERS, MEMBERS, (step + 1) * GROUPS)
    for name in ("pending", "routed", "cancellations"):
        _timed(cpu, name, getattr(store, name))
    ids = [g.group_id for g in groups]
    for g in groups:
        _timed(cpu, "reserved", store.set_group_version, g.group_id, step)
        _timed(cpu, "checkout", store.checkout, "inst-0", list(g.member_ids))
    members = [m for g in groups for m in g.member_ids]
    half = tuple(range(TOKENS // 2))
    _timed(cpu, "progress", store.checkpoint, [ProgressCheckpoint(m, "inst-0", 0, half, (-0.5,) * len(half), ((step, 0, len(half)),))
                                               for m in members], "inst-0")
    items = [{"instance_id": "inst-0", "trajectory": {
        "traj_id": m, "tokens": list(range(TOKENS)), "logprobs": [-0.5] * TOKENS,
        "segments": [{"version": step, "start": 0, "end": TOKENS}], "finish_reason": "stop"}} for m in members]
    _timed(cpu, "completed", store.completed, items)
    _timed(cpu, "rewarded", store.rewarded, {m: (1.0, "") for m in members})
    for g in groups:
        _timed(cpu, "occupy", store.close_group, g.group_id, GroupState.OCCUPIED)
    _timed(cpu, "consumed", store.mark_consumed, ids, step)
    _timed(cpu, "batch", store.batch, ids)
    _timed(cpu, "free", store.free, ids, step)


def _ledger_step(ledger: DurableLedger, params: LedgerParams, step: int, cursor: int,
                 cpu: dict[str, list[float]]) -> int:
    _timed(cpu, "reserve+occupy+consume", _fill_and_drain, ledger, params, f"s{step}")
    events = _timed(cpu, "events", ledger.events, cursor, 1_000)
    return events[-1]["id"] if events else cursor


def _skew(steps: int) -> LengthSkew:
    """The trajectory server's length-skew accounting after ``steps`` steps of the default shape."""
    skew = LengthSkew()
    for step in range(steps):
        ids = [f"{step}-{i}" for i in range(GROUPS * MEMBERS)]
        for i, traj_id in enumerate(ids):
            skew.sampled([traj_id], 0.0)
            skew.admitted(traj_id, 0.5)
            skew.generated(traj_id, 1 + (step * 7 + i * 13) % 2048)
        skew.consumed(step, [(traj_id, 1) for traj_id in ids])
    return skew


def _skew_step(skew: LengthSkew, cpu: dict[str, list[float]]) -> None:
    """What a step and a health probe read of it: the totals, and the step log's newest window."""
    _timed(cpu, "length skew: totals (health)", skew.totals)
    _timed(cpu, "length skew: step log read", skew.to_json, skew.step - 2)


def _ratios(small: dict[str, list[float]], large: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {name: {"small_ms": 1e3 * statistics.median(small[name]), "large_ms": 1e3 * statistics.median(large[name]),
                   "ratio": statistics.median(large[name]) / max(statistics.median(small[name]), 1e-9)}
            for name in small}


def run(steps: int, small_groups: int, large_groups: int, workdir: Path) -> dict:
    sizes = {"small": small_groups, "large": large_groups}
    params = LedgerParams(eta=2, batch_size=GROUPS)
    stores, ledgers, cursors = {}, {}, {}
    for name, groups in sizes.items():
        stores[name] = TrajectoryStore.open(f"sqlite:///{workdir / f'{name}-ts.db'}", "NORMAL")
        _archive(stores[name], groups)
        ledgers[name] = DurableLedger.open(f"sqlite:///{workdir / f'{name}-ledger.db'}", params, "NORMAL")
        _old_ledger(ledgers[name], groups, events=groups // GROUPS)
        cursors[name] = 0
    cpu: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in sizes}
    skews = {name: _skew(groups // GROUPS) for name, groups in sizes.items()}
    for step in range(steps):  # interleaved: the load of any moment weighs on both
        for name in sizes:
            start = time.process_time()
            _store_step(stores[name], step, cpu[name])
            cursors[name] = _ledger_step(ledgers[name], params, step, cursors[name], cpu[name])
            cpu[name]["step (store + ledger)"].append(time.process_time() - start)
            _skew_step(skews[name], cpu[name])
    archived = {name: stores[name].archived_count() for name in sizes}
    for _ in range(3):
        for name in sizes:
            stores[name].close()
            stores[name] = _timed(cpu[name], "trajectory store reopen", TrajectoryStore.open,
                                  f"sqlite:///{workdir / f'{name}-ts.db'}", "NORMAL")
            ledgers[name].close()
            ledgers[name] = _timed(cpu[name], "ledger reopen", DurableLedger.open,
                                   f"sqlite:///{workdir / f'{name}-ledger.db'}", params, "NORMAL")
    for name in sizes:
        stores[name].close()
        ledgers[name].close()
    return {"steps": steps, "archived_trajectories": archived,
            "db_bytes": {name: (workdir / f"{name}-ts.db").stat().st_size for name in sizes},
            "cpu": _ratios(cpu["small"], cpu["large"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--small-groups", type=int, default=900, help="archived groups of the young run (of 8)")
    parser.add_argument("--large-groups", type=int, default=32_000, help="archived groups of the old run (of 8)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.steps, args.small_groups, args.large_groups, Path(tmp))
    print(json.dumps({k: v for k, v in result.items() if k != "cpu"}))
    print(f"{'call':30} {'small ms':>9} {'large ms':>9} {'large/small':>11}")
    for name, r in result["cpu"].items():
        print(f"{name:30} {r['small_ms']:9.3f} {r['large_ms']:9.3f} {r['ratio']:10.2f}x")


if __name__ == "__main__":
    main()
