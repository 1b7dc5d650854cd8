"""Rollout instances derived from hardware: how many tokens of KV cache one instance holds and
what its decode and prefill cost, from the GPU, the model's shape and the tensor-parallel degree.

Pure arithmetic. Every number the presets use is here with its source, so that a reader can check
it and a user can build an instance for another GPU or model (``RolloutInstance``).

KV capacity (vLLM's rule): ``tp x memory x gpu_memory_utilization - weights - activations``,
divided by the KV bytes of one token, ``2 (K and V) x layers x kv_heads x head_dim x dtype bytes``
(each of the ``tp`` GPUs holds ``kv_heads / tp`` heads, so the per-instance total is the same).

Decode cost (paper Appendix B, Eq. 11, per token ``k5 = 1`` as in the authors' cost-model file
``qwen_moe_30b.json``, keyed ``TP1_PP1``, whose attention coefficient multiplies a token count):

* ``k1`` seconds per KV token read in a step: KV bytes per token / effective attention bandwidth;
* ``k2`` memory-bound floor of the GEMMs: bytes of the weights a step reads / effective bandwidth;
* ``k3`` seconds per running sequence once the GEMMs are compute-bound: 2 x active parameters /
  effective FLOP/s;
* ``k4`` fixed per-step overhead.

For Qwen3-30B-A3B on one H20 the four are the paper's Table 4, measured by the authors; the
efficiencies they imply (``MOE_EFFICIENCY``) derive the coefficients of the other models.

Prefill cost: ``k3`` per context token (the cost model's own price of a token through the
compute-bound GEMMs) plus causal attention, ``4 x layers x q_heads x head_dim`` FLOPs per
(query, key) pair over ``c^2 / 2`` pairs at the same effective FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.cost_model import PAPER_K1, PAPER_K2, PAPER_K3, PAPER_K4, CostModel

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float  # HBM
    bf16_flops: float  # dense


# NVIDIA H20 datasheet: 96 GB HBM3, 4.0 TB/s, 148 TFLOPS dense BF16 (the paper's testbed, §6.1).
H20 = Gpu("H20", 96 * GB, 4.0e12, 148e12)


@dataclass(frozen=True)
class ModelShape:
    name: str
    parameters: float  # all weights
    active_parameters: float  # per token (MoE: attention + routed experts)
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair over every layer: Q.K and A.V, a multiply-add each."""
        return 4 * self.layers * self.q_heads * self.head_dim


# Hugging Face config.json of each model (num_hidden_layers, num_attention_heads,
# num_key_value_heads, head_dim) and its model card (parameter counts).
QWEN3_30B_A3B = ModelShape("Qwen3-30B-A3B", 30.5e9, 3.3e9, layers=48, q_heads=32, kv_heads=4, head_dim=128)
QWEN3_32B = ModelShape("Qwen3-32B", 32.8e9, 32.8e9, layers=64, q_heads=64, kv_heads=8, head_dim=128)


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet a real engine reaches."""

    weight_read: float  # of HBM bandwidth, reading weights (k2)
    kv_read: float  # of HBM bandwidth, reading KV in attention (k1)
    flops: float  # of dense BF16 FLOP/s (k3 and prefill)


# What Table 4 implies for Qwen3-30B-A3B on one H20 (k5 = 1):
#   k2 = 1.72e-3 s reads 3.3e9 x 2 bytes of active weights: 6.6e9 / 1.72e-3 / 4e12 = 0.96;
#   k1 = 7.28e-8 s per token of 98,304 bytes: 1.35 TB/s, 0.34 of 4 TB/s (paged attention, GQA);
#   k3 = 1.25e-4 s per sequence for 2 x 3.3e9 FLOPs: 53 TFLOP/s, 0.36 of 148 TFLOP/s.
MOE_EFFICIENCY = Efficiency(
    weight_read=QWEN3_30B_A3B.active_parameters * 2 / PAPER_K2 / H20.bandwidth_bytes_per_s,
    kv_read=QWEN3_30B_A3B.kv_bytes_per_token / PAPER_K1 / H20.bandwidth_bytes_per_s,
    flops=2 * QWEN3_30B_A3B.active_parameters / PAPER_K3 / H20.bf16_flops,
)


@dataclass(frozen=True)
class RolloutInstance:
    """One rollout instance: ``tp`` GPUs serving one model with vLLM-like memory rules."""

    gpu: Gpu
    model: ModelShape
    tp: int = 1
    gpu_memory_utilization: float = 0.9  # vLLM's default, and the authors' scripts
    activation_bytes_per_gpu: float = 3.5 * GB  # vLLM's profiled peak (activations, CUDA graphs, sampler)
    efficiency: Efficiency = MOE_EFFICIENCY
    step_overhead_s: float = PAPER_K4  # k4 of one GPU; grows with layers and TP below

    def __post_init__(self) -> None:
        if self.tp < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("tp must be >= 1 and gpu_memory_utilization within (0, 1]")
        if self.kv_tokens < 1:
            raise ValueError(f"{self.model.name} does not fit {self.tp} x {self.gpu.name} with room for KV cache")

    @property
    def kv_bytes(self) -> float:
        usable = self.tp * self.gpu.memory_bytes * self.gpu_memory_utilization
        return usable - self.model.weight_bytes - self.tp * self.activation_bytes_per_gpu

    @property
    def kv_tokens(self) -> int:
        return int(self.kv_bytes // self.model.kv_bytes_per_token)

    @property
    def effective_flops(self) -> float:
        return self.tp * self.gpu.bf16_flops * self.efficiency.flops

    def cost_model(self) -> CostModel:
        """Eq. 11's coefficients per token (k5 = 1) and the KV budget in tokens."""
        bandwidth = self.tp * self.gpu.bandwidth_bytes_per_s
        if self.model == QWEN3_30B_A3B and self.gpu == H20 and self.tp == 1:
            return CostModel(kv_budget=float(self.kv_tokens))  # Table 4 as measured
        k1 = self.model.kv_bytes_per_token / (bandwidth * self.efficiency.kv_read)
        k2 = self.model.active_parameters * self.model.dtype_bytes / (bandwidth * self.efficiency.weight_read)
        k3 = 2 * self.model.active_parameters / self.effective_flops
        # per-layer launches and norms scale with depth; each TP rank adds two all-reduces per layer
        k4 = self.step_overhead_s * self.model.layers / QWEN3_30B_A3B.layers * (1 + 0.15 * (self.tp - 1))
        return CostModel(k1=k1, k2=k2, k3=k3, k4=k4, k5=1.0, kv_budget=float(self.kv_tokens))

    @property
    def prefill_seconds_per_token(self) -> float:
        """The linear part of prefill: one token through the compute-bound GEMMs (= k3)."""
        return self.cost_model().k3

    @property
    def prefill_attention_seconds(self) -> float:
        """Seconds per (query, key) pair of causal prefill attention: a context of ``c`` tokens
        adds ``this x c^2 / 2``."""
        return self.model.attention_flops_per_pair / self.effective_flops

    @property
    def weight_bytes(self) -> int:
        return int(self.model.weight_bytes)
