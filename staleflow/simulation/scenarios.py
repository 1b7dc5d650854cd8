"""Cluster scenarios (presets) and user workloads for the cluster simulation.

A scenario fixes everything but the system and the staleness bound: the workload, the GPU
budget, how many GPUs one rollout instance takes, which rollout/training splits a disaggregated
system may choose from, the engine, the trainer and the coordinator timing.

Paper scenarios (§6.1, Table 2, and the authors' scripts ``examples/paper_exp/e2e/*.sh`` in
``Somoku/psrl`` at commit 968b836): 128 H20 GPUs, B = 128 groups of G = 16, 20 training steps.

* ``paper-20k`` / ``paper-40k``: Qwen3-30B-A3B, one rollout instance per GPU (``GEN_TP=1``), the
  paper's Table 4 cost model per token (the authors' ``qwen_moe_30b.json`` is keyed ``TP1_PP1``
  and its attention coefficient multiplies a token count) and the KV capacity of one H20 at
  ``gpu_memory_utilization = 0.9`` (``hardware.RolloutInstance``: 86.4 GB - 61 GB of weights -
  3.5 GB of activations = 21.9 GB, 98,304 bytes per token: about 223K tokens). Splits at node
  granularity in the proportions of the authors' 64-GPU scripts (2+6, 3+5 and 4+4 nodes of rollout
  + training): 32, 48 or 64 rollout instances, the rest trains.
* ``paper-dense-32b``: Qwen3-32B on TP2 instances (2 GPUs: 65.6 GB of weights, 256 KB per token,
  about 382K tokens), decode coefficients derived with the efficiencies Table 4 implies; 16, 24 or
  32 rollout instances.

Prefill: the cost model's ``k3`` per context token plus causal attention (``hardware``). Trainer:
6.5e-4 GPU-seconds per trained token for the MoE (about 26 GFLOPs per token, forward, backward and
log-prob recomputation over 3.3B active parameters, at 40 TFLOP/s, 27 % of an H20), 5.1e-3 for the
dense 32B (8 x 32.8B FLOPs at 35 % MFU), 5 s of overhead per step, 3 s to push weights to the
parameter server. VeRL-like baselines broadcast weights over NCCL instead (``nccl_broadcast_s``,
see ``NCCL_BROADCAST_S``).

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

from staleflow.config.engines import SimParams
from staleflow.cost_model import CostModel
from staleflow.simulation.hardware import H20, QWEN3_30B_A3B, QWEN3_32B, RolloutInstance
from staleflow.simulation.settings import CommandCosts, TrainerModel
from staleflow.simulation.systems import REDUNDANCY_RATIO
from staleflow.simulation.transfer import WeightTransfer
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
    steps: int = 20  # the authors' total_training_steps
    straggler_sigma: float = 0.0  # persistent per-instance speed spread (log-normal sigma)
    nccl_broadcast_s: float = 8.1  # VeRL-like systems' weight sync, trainer and instances blocked
    transfer: WeightTransfer = field(default_factory=WeightTransfer)  # Pulls: from the PS (unlimited) unless set

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


# VeRL-like weight sync: an NCCL broadcast of the bf16 weights from the trainer to every instance,
# trainer and instances blocked. The paper's Figure 19 compares sync times only as a plot
# (StaleFlow's Pull is "the minimal latency in most settings"); 61 GB at an effective 10 GB/s
# (bucketed per-tensor broadcasts gathered from FSDP shards over 400 Gb/s links) plus 2 s of
# pausing and resuming the engines is an estimate, swept with ``--sweep nccl=...``.
NCCL_BROADCAST_S = 2.0 + QWEN3_30B_A3B.weight_bytes / 10e9
MOE_TRAINER = TrainerModel(gpu_seconds_per_token=6.5e-4, step_overhead_s=5.0, push_s=3.0)
DENSE_32B_TRAINER = TrainerModel(gpu_seconds_per_token=5.1e-3, step_overhead_s=5.0, push_s=3.0)
MAX_NUM_SEQS = 256  # StaleFlow's vLLM max_num_seqs (the authors used 96-256; baselines 1024)


def instance_params(instance: RolloutInstance) -> SimParams:
    """The simulated engine of one hardware-derived rollout instance."""
    cost = instance.cost_model()
    return SimParams(cost=cost, prefill_seconds_per_token=cost.k3,
                     prefill_attention_seconds=instance.prefill_attention_seconds,
                     model_bytes=instance.weight_bytes, max_running=MAX_NUM_SEQS)


def _paper(name: str, workload: str) -> Scenario:
    return Scenario(
        name=name,
        workload=preset(workload),
        total_gpus=128,
        gpus_per_instance=1,
        rollout_candidates=(32, 48, 64),
        sim=instance_params(RolloutInstance(H20, QWEN3_30B_A3B)),
        trainer=MOE_TRAINER,
        nccl_broadcast_s=NCCL_BROADCAST_S,
    )


def _dense() -> Scenario:
    instance = RolloutInstance(H20, QWEN3_32B, tp=2)
    return Scenario(
        name="paper-dense-32b",
        workload=replace(preset("paper-20k"), name="paper-dense-32b"),
        total_gpus=128,
        gpus_per_instance=2,
        rollout_candidates=(16, 24, 32),
        sim=instance_params(instance),
        trainer=DENSE_32B_TRAINER,
        nccl_broadcast_s=2.0 + instance.weight_bytes / 10e9,
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
        steps=10,
        nccl_broadcast_s=0.2,
    )


def _paper_40k() -> Scenario:
    # trajectories run about twice as long as in paper-20k: a proportionally longer cycle (results move < 1.5 %)
    return replace(_paper("paper-40k", "paper-40k"), cycle_period_s=4.0, recheck_period_s=20.0)


SCENARIOS = {"ci": _ci, "paper-20k": lambda: _paper("paper-20k", "paper-20k"), "paper-40k": _paper_40k,
             "paper-dense-32b": _dense}


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
