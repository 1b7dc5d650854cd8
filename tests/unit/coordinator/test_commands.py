"""A cycle plan as commands (``staleflow.commands``): the one translation the coordinator and the
cluster simulation share."""

from __future__ import annotations

from staleflow.commands import commands_of
from staleflow.strategies import CyclePlan, RouteDecision


def test_routes_are_one_checkout_per_instance_in_the_plans_order() -> None:
    plan = CyclePlan(
        syncs=["b"],
        interrupts={"b": ["t1", "t2"], "c": ["t3"]},
        routes=[RouteDecision("a", "t4", "g4", 2, True), RouteDecision("c", "t1", "g1", 1, False),
                RouteDecision("a", "t5", "g4", 2, False), RouteDecision("b", "t2", "g2", 1, False)],
    )
    commands = commands_of(plan)
    assert commands.interrupts == {"b": ["t1", "t2"], "c": ["t3"]}
    assert commands.pulls == ["b"]
    assert list(commands.routes) == ["a", "c", "b"], "instances in the order the plan first names them"
    assert commands.routes == {"a": [("t4", 2), ("t5", 2)], "c": [("t1", 1)], "b": [("t2", 1)]}


def test_an_empty_plan_issues_nothing() -> None:
    commands = commands_of(CyclePlan())
    assert not (commands.interrupts or commands.pulls or commands.routes)


def test_a_kept_pull_says_so_and_interrupts_nothing_for_itself() -> None:
    commands = commands_of(CyclePlan(syncs=["a", "b"], kept=["a"], interrupts={"b": ["t1"]}))
    assert commands.pulls == ["a", "b"] and commands.kept == {"a"}
    assert commands.interrupts == {"b": ["t1"]}
    assert commands_of(CyclePlan(syncs=["a"])).kept == frozenset()
