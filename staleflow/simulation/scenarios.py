"""Cluster scenarios (presets) and user workloads for the cluster simulation.

A scenario fixes everything but the system and the staleness bound: the workload, the GPU
budget, how many GPUs one rollout instance takes, which rollout/training splits a disaggregated
system may choose from, the engine, the trainer and the coordinator timing.

Paper scenarios (``paper-20k``, ``paper-40k``; §6.1 and §6.5): 128 GPUs, 4 per rollout instance
(a colocated system runs 32 instances), B = 128 groups of G = 16. Engine: the paper's Table 4 cost
model with a KV budget of 2M tokens per instance. Table 4 does not say in which unit ``kv_cache``
is counted; ``k1`` is "the inverse effective memory bandwidth for accessing the KV cache"
(Appendix B). Counted in tokens, k1 = 7.28e-8 s would mean reading one token's KV (Qwen3-30B-A3B:
48 layers x 4 KV heads x 128 x 2 x 2 bytes = 98 KB) at 1.35 TB/s, 8 % of the 16 TB/s HBM of a
4 x H20 instance; a unit of 8 tokens (k5 = 1/8) is 67 % of it, what paged attention reaches. The
presets therefore count one KV unit as 8 tokens (``paper_cost``); ``--sweep k5=...`` shows what the
other readings give. Prefill costs ``k3`` seconds per token: prefill
is compute-bound, and ``k3`` is the cost model's own price of one token through the GEMMs in the
compute-bound regime (the engine default, 2e-5, would make re-prefill 6x cheaper than decoding a
token at large batch). Trainer: 6.5e-4 GPU-seconds per trained token (about 1,500 tokens/s per
GPU for a 3B-active MoE with log-prob recomputation, ~36 % MFU on an H20), 5 s per step of fixed
overhead, 3 s to push weights; with the default splits training takes roughly half of a
rollout-bound step, so rollout dominates as in the paper's Figure 1.

Workload files (``load_workload``): a JSON list of groups of response lengths
(``[[120, 300, ...], ...]``), JSONL with one group per line (a list, or an object with a
``lengths`` list), or a JSON object describing a distribution (``WorkloadModel`` fields, with
the aliases ``median``, ``max_tokens``, ``sigma`` for ``member_sigma``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field, fields, replace

from staleflow.cost_model import CostModel
from staleflow.engines.sim import SimParams
from staleflow.simulation.settings import CommandCosts, TrainerModel
from staleflow.simulation.systems import REDUNDANCY_RATIO
from staleflow.workload import WorkloadModel, preset


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: WorkloadModel
    total_gpus: int
    gpus_per_instance: int
    rollout_candidates: tuple[int, ...]  # rollout instance counts a disaggregated system may choose from
    sim: SimParams
    trainer: TrainerModel
    commands: CommandCosts = field(default_factory=CommandCosts)
    cycle_period_s: float = 2.0
    recheck_period_s: float = 10.0
    redundancy: float = REDUNDANCY_RATIO

    def __post_init__(self) -> None:
        if self.gpus_per_instance < 1 or self.total_gpus < 2 * self.gpus_per_instance:
            raise ValueError("the GPU budget must hold a rollout instance and a trainer")
        if not self.rollout_candidates:
            raise ValueError("rollout_candidates must not be empty")
        for n in self.rollout_candidates:
            self.train_gpus(n)

    @property
    def colocated_instances(self) -> int:
        return self.total_gpus // self.gpus_per_instance

    def train_gpus(self, rollout_instances: int) -> int:
        left = self.total_gpus - rollout_instances * self.gpus_per_instance
        if rollout_instances < 1 or left < 1:
            raise ValueError(f"{rollout_instances} instances of {self.gpus_per_instance} GPUs leave no trainer GPU "
                             f"in a budget of {self.total_gpus}")
        return left

    def with_gpus(self, total_gpus: int) -> Scenario:
        """The same scenario on another GPU budget; candidate splits scale with it."""
        scale = total_gpus / self.total_gpus
        limit = total_gpus // self.gpus_per_instance - 1
        candidates = tuple(sorted({min(limit, max(1, round(n * scale))) for n in self.rollout_candidates}))
        return replace(self, total_gpus=total_gpus, rollout_candidates=candidates)


# One KV unit of Table 4's k1 is PAPER_KV_TOKENS_PER_UNIT tokens (see the module docstring).
PAPER_KV_TOKENS_PER_UNIT = 8
PAPER_KV_BUDGET_TOKENS = 2_000_000


def paper_cost(tokens_per_unit: float = PAPER_KV_TOKENS_PER_UNIT) -> CostModel:
    """Table 4 with a KV unit of ``tokens_per_unit`` tokens and a 2M-token KV budget."""
    k5 = 1.0 / tokens_per_unit
    return CostModel(k5=k5, kv_budget=PAPER_KV_BUDGET_TOKENS * k5)


def _paper(name: str) -> Scenario:
    cost = paper_cost()
    return Scenario(
        name=name,
        workload=preset(name),
        total_gpus=128,
        gpus_per_instance=4,
        rollout_candidates=(18, 20, 22, 24, 26),
        sim=SimParams(cost=cost, prefill_seconds_per_token=cost.k3),
        trainer=TrainerModel(gpu_seconds_per_token=6.5e-4, step_overhead_s=5.0, push_s=3.0),
    )


def _ci() -> Scenario:
    return Scenario(
        name="ci",
        workload=preset("ci-tiny"),
        total_gpus=8,
        gpus_per_instance=2,
        rollout_candidates=(2, 3),
        # a KV budget of ~10 trajectories, so preemption, waiting queues and migration all happen
        sim=SimParams(cost=CostModel(kv_budget=400), model_bytes=100_000_000, pull_latency_s=0.05, max_running=16,
                      prefill_seconds_per_token=1.25e-4),
        trainer=TrainerModel(gpu_seconds_per_token=2e-3, step_overhead_s=0.1, push_s=0.05),
        commands=CommandCosts(route_command_s=0.002, route_traj_s=0.0005, interrupt_command_s=0.002,
                              interrupt_traj_s=0.0002),
        cycle_period_s=0.05,
        recheck_period_s=0.25,
        redundancy=0.25,  # B = G = 4: 1/16 would add nothing
    )


def _paper_40k() -> Scenario:
    # trajectories run about twice as long as in paper-20k: a proportionally longer cycle (results move < 1.5 %)
    return replace(_paper("paper-40k"), cycle_period_s=4.0, recheck_period_s=20.0)


SCENARIOS = {"ci": _ci, "paper-20k": lambda: _paper("paper-20k"), "paper-40k": _paper_40k}


def scenario(name: str, seed: int = 0) -> Scenario:
    try:
        s = SCENARIOS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(SCENARIOS)}") from None
    return replace(s, workload=s.workload.with_seed(seed), sim=replace(s.sim, seed=seed))


# ---------------------------------------------------------------------- user workloads


@dataclass(frozen=True)
class ReplayWorkload(WorkloadModel):
    """Response lengths replayed from a file: group ``n`` of the job uses recorded group
    ``n mod len(lengths)``, member ``m`` its length ``m mod len(group)``."""

    lengths: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lengths or any(not g or min(g) < 1 for g in self.lengths):
            raise ValueError("a replayed workload needs non-empty groups of lengths >= 1")

    def natural_length(self, group_id: str, traj_id: str) -> int:
        step, _, index = group_id[1:].partition("-g")
        member = int(traj_id.rpartition("/m")[2])
        group = self.lengths[(int(step) * self.batch_size + int(index)) % len(self.lengths)]
        return group[member % len(group)]


_ALIASES = {"median": "response_median", "max_tokens": "max_response_tokens", "sigma": "member_sigma",
            "batch": "batch_size", "group": "group_size"}
_SPEC_FIELDS = {f.name for f in fields(WorkloadModel)} - {"name", "seed"}


def load_workload(text: str, base: WorkloadModel, name: str = "file") -> WorkloadModel:
    """A workload from a file's text (see the module docstring); ``base`` supplies what it leaves out."""
    text = text.strip()
    if not text:
        raise ValueError("the workload file is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON or JSONL: {exc}") from None
    if isinstance(data, dict) and "groups" not in data and "lengths" not in data:
        return _distribution(data, base, name)
    if isinstance(data, dict):
        data = data.get("groups", data.get("lengths"))
    groups = [_group(g) for g in data] if isinstance(data, list) else None
    if not groups:
        raise ValueError("expected a list of groups of response lengths, e.g. [[120, 300], [800, 950]]")
    sizes = Counter(len(g) for g in groups)
    longest = max(max(g) for g in groups)
    values = {f.name: getattr(base, f.name) for f in fields(WorkloadModel)}
    values.update(name=name, group_size=sizes.most_common(1)[0][0], max_response_tokens=longest)
    return ReplayWorkload(**values, lengths=tuple(groups))


def _group(item: object) -> tuple[int, ...]:
    if isinstance(item, dict):
        item = item.get("lengths")
    if not isinstance(item, list) or not item:
        raise ValueError(f"a group must be a non-empty list of lengths, got {item!r}")
    lengths = []
    for x in item:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 1:
            raise ValueError(f"response lengths must be numbers >= 1, got {x!r}")
        lengths.append(int(round(x)))
    return tuple(lengths)


def _distribution(spec: dict, base: WorkloadModel, name: str) -> WorkloadModel:
    kind = spec.get("distribution", "lognormal")
    if kind != "lognormal":
        raise ValueError(f"only the 'lognormal' distribution is supported, got {kind!r}")
    changes = {}
    for key, value in spec.items():
        if key == "distribution":
            continue
        target = _ALIASES.get(key, key)
        if target not in _SPEC_FIELDS:
            raise ValueError(f"unknown workload field {key!r}; use {sorted(_SPEC_FIELDS | set(_ALIASES))}")
        changes[target] = value
    return replace(base, name=name, **changes)
