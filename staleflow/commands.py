"""The commands a coordinator cycle's plan becomes, in the order they are issued: the one
translation shared by the coordinator service and the cluster simulation.

1. **Interrupts** (migrations' and syncs'): the partials they return go back to the trajectory
   server before anything is checked out.
2. **Pulls**, one per syncing instance, queued behind that instance's Interrupt; ``kept`` names
   those that keep the instance's trajectories (``keep_running``).
3. **Routes**: per instance, one checkout of its ``(traj_id, v_traj)`` assignments at the
   trajectory server (which reserves new groups in the ledger first), then one Route of what it
   granted, queued behind that instance's Pull.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.strategies import CyclePlan


@dataclass(frozen=True)
class Commands:
    interrupts: dict[str, list[str]]  # instance -> trajectories to hand back
    pulls: list[str]  # instances that load the newest weights
    routes: dict[str, list[tuple[str, int]]]  # instance -> (traj_id, v_traj) to check out and route there
    kept: frozenset[str] = frozenset()  # the pulls that keep the instance's trajectories and their KV


def commands_of(plan: CyclePlan) -> Commands:
    routes: dict[str, list[tuple[str, int]]] = {}
    for d in plan.routes:
        routes.setdefault(d.instance_id, []).append((d.traj_id, d.v_traj))
    return Commands(dict(plan.interrupts), list(plan.syncs), routes, frozenset(plan.kept))
