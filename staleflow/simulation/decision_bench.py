"""The coordinator decision benchmark (``staleflow bench coordinator``, ``run_decision_bench``): the
time of one decision pass (sync, migration, routing) as instances and waiting trajectories grow, with
the coordinator's default strategy or the one the simulated StaleFlow runs."""

from __future__ import annotations

import statistics
import time
import tracemalloc
from collections.abc import Callable


def _decision_scenario(n_instances: int, n_trajectories: int, steady: bool, seed: int = 0):
    """Instances and waiting trajectories for one decision pass. ``steady``: a loaded fleet at
    mixed versions with partial trajectories waiting; otherwise an idle fleet and a fresh batch."""
    import random

    from staleflow.cost_model import CostModel
    from staleflow.strategies import InstanceState, PendingTrajectory

    rng = random.Random(seed)
    cost = CostModel()
    instances, pending = [], []
    for i in range(n_instances):
        if steady:
            running = rng.randint(5, 80)
            waiting = rng.choice([0, 0, 0, rng.randint(1, 8)])
            instances.append(InstanceState(f"i{i}", rng.choice([2, 3, 3, 4]), float(running * rng.randint(300, 3000)),
                                           [f"i{i}-r{k}" for k in range(running)],
                                           [f"i{i}-w{k}" for k in range(waiting)], cost))
        else:
            instances.append(InstanceState(f"i{i}", 0, 0.0, [], [], cost))
    group_size = 16
    prompt_lengths: dict[int, int] = {}
    for k in range(n_trajectories):
        g = k // group_size
        if steady and g % 3 == 0:  # interrupted partials of versioned groups
            pending.append(PendingTrajectory(f"t{k}", f"g{g}", rng.choice([1, 2, 3]), rng.randint(300, 15000), k))
        else:  # initial: the members of a group share their prompt
            length = prompt_lengths.setdefault(g, rng.randint(100, 2000))
            pending.append(PendingTrajectory(f"t{k}", f"g{g}", None, length, k))
    admission = {1: 0, 2: 64, 3: 128, 4: 256} if steady else {0: 10**6}
    return instances, pending, (4 if steady else 0), admission


DECISION_STRATEGIES = {"default": None, "staleflow": "sf-rsm", "repack": "sf-rsm+repack"}


def decision_strategy(name: str):
    """``default``: the coordinator's ``StrategyConfig()``; ``staleflow``: the strategies the
    simulated StaleFlow runs (load-aware sync, starved migration); ``repack``: those and repack,
    every pass a repack check on which every instance's KV utilisation has fallen."""
    from staleflow.config.strategy import StrategyConfig

    if name not in DECISION_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(DECISION_STRATEGIES)}, got {name!r}")
    system = DECISION_STRATEGIES[name]
    if system is None:
        return StrategyConfig()
    from staleflow.simulation.systems import resolve

    return resolve(system)[0].strategy


def run_decision_bench(instance_counts: list[int], trajectory_counts: list[int], repeats: int,
                       strategy: str = "default", advance: Callable[[], None] = lambda: None) -> dict:
    """``advance`` is called after each of the ``decision_bench_cells`` cells. Each row has the
    median wall time of a pass, the minimum and median CPU time of the process (what a loaded
    machine does not inflate as much) and the peak of the memory a pass allocates (tracemalloc,
    one more pass)."""
    from staleflow.strategies import plan_cycle
    from staleflow.strategies.repack import kv_utilisation

    config = decision_strategy(strategy)
    rows = []
    for steady in (False, True):
        for n_inst in instance_counts:
            for n_traj in trajectory_counts:
                instances, pending, ps_version, admission = _decision_scenario(n_inst, n_traj, steady)
                previous = {i.instance_id: kv_utilisation(i) + 0.01 for i in instances} \
                    if config.migration.repacks else None
                times, cpu = [], []
                for _ in range(repeats):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    plan = plan_cycle(instances, pending, ps_version, admission, config, repack_previous=previous)
                    cpu.append(1e3 * (time.process_time() - start_cpu))
                    times.append(1e3 * (time.perf_counter() - start))
                tracemalloc.start()
                plan_cycle(instances, pending, ps_version, admission, config, repack_previous=previous)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                rows.append({"scenario": "steady" if steady else "initial fill", "instances": n_inst,
                             "trajectories": n_traj, "median_ms": statistics.median(times),
                             "cpu_min_ms": min(cpu), "cpu_median_ms": statistics.median(cpu),
                             "peak_mib": peak / 2**20, "routed": len(plan.routes),
                             "syncs": len(plan.syncs), "interrupted": sum(map(len, plan.interrupts.values())),
                             "repacks": len(plan.repacks)})
                advance()
    return {"repeats": repeats, "strategy": strategy, "rows": rows}


def decision_bench_cells(instance_counts: list[int], trajectory_counts: list[int]) -> int:
    return 2 * len(instance_counts) * len(trajectory_counts)
