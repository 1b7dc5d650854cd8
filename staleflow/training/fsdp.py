"""The FSDP2 trainer: GRPO/DAPO on a Hugging Face causal LM, sharded with ``fully_shard``.

Rank 0 runs the trainer role (``TrainerLoop``: consume, fetch, push, free; its process
orchestration is ``staleflow.training.role.run_fsdp_trainer``) with a ``RankDriver`` backend
that broadcasts each call (train, weights, checkpoint) to the other ranks, which run the same call
on their shard (``follow``). Weights are pushed by every rank at once, each its own shards (no
gather on rank 0); the parameter server makes the version visible when all of them are in.
Each rank sees its version through to visible, across parameter-server restarts, and keeps its
share until the PS persisted it (``SharePusher``, ``BackgroundSharePushes`` in ``base``).
Every rank trains an equal number of micro-batches of its share of the batch, so the FSDP
collectives line up. gloo on CPU, NCCL on GPU.

Checkpoints are ``torch.distributed.checkpoint`` directories (model and optimizer, sharded) plus a
``latest.json`` written last; a restarted trainer loads the newest and resumes from its version.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from staleflow.config import TrainerConfig, TrainerRoleConfig
from staleflow.training.attention import packed_inputs, packing_for
from staleflow.training.base import BackgroundSharePushes, ShardedWeights, TrainerBackend
from staleflow.training.export import ShareStaging, export_dtype, local_shards
from staleflow.training.grpo import group_advantages, policy_loss
from staleflow.training.layers import apply_liger_layers, checkpointing_for, fused_kernels_for, prepare_layers
from staleflow.training.loading import decoder_layers, empty_causal_lm, load_sharded, materialize
from staleflow.training.logprobs import HeadTimer, chunk_tokens_for, head_returns_logprobs, liger_available
from staleflow.training.memory_model import CheckpointingPolicy, DecoderShape, policy_of, resolve_token_budget
from staleflow.training.schedule import learning_rate

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

CHECKPOINTS_KEPT = 2


class FsdpBackend(TrainerBackend):
    """One rank's shard of the policy, its optimizer and its checkpoints."""

    def __init__(self, cfg: TrainerConfig, model_dir: Path, checkpoint_dir: Path, rank: int, world: int,
                 final_version: int):
        self.cfg, self.algo = cfg, cfg.algorithm
        self.rank, self.world = rank, world
        self.checkpoint_dir = checkpoint_dir
        self.final_version = final_version
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.settings = resolve_settings(cfg, self.device)
        torch.manual_seed(0)
        resuming = (checkpoint_dir / "latest.json").exists()
        self.packing = False  # decided from the model's attention as it is built (``_sharded``)
        self.model = self._sharded(model_dir, trainable=True, load=not resuming)
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.pad_id = self.model.config.pad_token_id or 0
        self.chunk_tokens = chunk_tokens_for(self.model.config.vocab_size, self.settings.logprob_chunk_tokens,
                                             self.device)
        self.token_budget = resolve_token_budget(
            cfg, self.device, DecoderShape.of(self.model.config, sum(p.numel() for p in self.model.parameters())),
            policy_of(self.settings.activation_checkpointing), self.settings.mixed_precision, self.chunk_tokens, world)
        self.head_timer: HeadTimer | None = None  # the bench's: time spent in the log-prob head
        self.reference = self._sharded(model_dir, trainable=False, load=True) if self.algo.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.algo.lr, weight_decay=self.algo.weight_decay,
                                           fused=True if self.device.type == "cuda" and not cfg.optimizer_offload else None)
        self.version = self._load_checkpoint()
        self._pushes: BackgroundSharePushes | None = None  # ranks > 0: their shares, one version at a time

    def _sharded(self, model_dir: Path, trainable: bool, load: bool) -> PreTrainedModel:
        """The model built on the meta device, each decoder layer and then the root wrapped with
        ``fully_shard``, and only this rank's shards allocated and read from ``model_dir``."""
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.settings.mixed_precision else MixedPrecisionPolicy())
        offload = (CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cfg.optimizer_offload and trainable
                   else OffloadPolicy())
        model = empty_causal_lm(model_dir)
        model.config.use_cache = False  # a cache would also hide packed rows from transformers' mask detection
        self.packing = packing_for(model, self.cfg.packing, self.device)
        if fused_kernels_for(self.cfg.fused_kernels, self.device, model.config.model_type, self.settings.compile):
            apply_liger_layers(model)
        layers = decoder_layers(model)
        if trainable:
            prepare_layers(model, layers, self.settings.activation_checkpointing, self.settings.compile)
        for layer in layers:
            fully_shard(layer, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mp_policy=mp, offload_policy=offload)
        for before, after in zip(layers, layers[1:], strict=False):  # gather the next layer while this one computes
            if isinstance(before, FSDPModule) and isinstance(after, FSDPModule):
                before.set_modules_to_forward_prefetch([after])
                after.set_modules_to_backward_prefetch([before])
        materialize(model, self.device, torch.device("cpu") if isinstance(offload, CPUOffloadPolicy) else None)
        if load:
            load_sharded(model, model_dir)
        model.train(trainable)
        model.requires_grad_(trainable)
        return model

    # -- TrainerBackend ------------------------------------------------------------------

    label = "FSDP2 trainer"

    def resume_version(self) -> int | None:
        return self.version

    def train(self, version: int, batch: Mapping[str, Any]) -> dict[str, float]:
        started = time.perf_counter()
        trajs = batch["trajectories"]
        rewards = torch.tensor([float(t["reward"]) for t in trajs], dtype=torch.float64)
        group_ids = {g: i for i, g in enumerate(sorted({t["group_id"] for t in trajs}))}
        groups = torch.tensor([group_ids[t["group_id"]] for t in trajs])
        advantages = group_advantages(rewards, groups, self.algo.normalize_std).float()
        global_tokens = float(sum(len(t["tokens"]) for t in trajs))
        mine = list(range(self.rank, len(trajs), self.world))
        chunks = self._micro_batches(trajs, mine)
        count = torch.tensor([len(chunks)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank runs as many micro-batches: the collectives line up
        chunks += [[]] * (int(count.item()) - len(chunks))
        # statistics stay on the device until the step ends: no host sync inside the loop
        totals: dict[str, torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for chunk in chunks:
            rows = [trajs[i] for i in chunk] or [trajs[0]]  # an empty share still joins the collectives
            inputs, head, mask, behaviour = self._tensors(rows, live=bool(chunk))
            logp = self._token_logp(self.model, inputs, head)
            reference = None
            if self.reference is not None:
                with torch.no_grad():
                    reference = self._token_logp(self.reference, inputs, head)
            adv = self._to_device(advantages[chunk] if chunk else torch.zeros(1))
            terms = policy_loss(logp, behaviour, adv, mask, self.algo, global_tokens=global_tokens,
                                global_sequences=float(len(trajs)), reference=reference)
            (terms.loss * self.world).backward()  # FSDP averages gradients over ranks: undo it
            loss_sum += terms.loss.detach().double()
            for k, v in terms.stats.items():
                v = v.detach().double()
                totals[k] = torch.maximum(totals[k], v) if k.endswith("_max") and k in totals else totals.get(k, 0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.algo.max_grad_norm)
        from torch.distributed.tensor import DTensor

        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        lr = learning_rate(self.algo, version, self.final_version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version = version + 1
        names = [k for k in sorted(totals) if not k.endswith("_max")]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        summed = torch.stack([loss_sum, *(totals[k] for k in names)])
        maxima = torch.stack([totals[k] for k in sorted(totals) if k.endswith("_max")] or [zero])
        dist.all_reduce(summed)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        values = torch.cat([summed, maxima[:1], grad_norm.detach().double().reshape(1).to(self.device)]).tolist()
        loss, sums = values[0], dict(zip(names, values[1:len(names) + 1], strict=True))
        tokens = max(sums.get("tokens", 0.0), 1.0)
        metrics = {
            "loss": loss,
            "grad_norm": values[-1],
            "importance_weight_mean": sums.get("importance_weight", 0.0) / tokens,
            "importance_weight_max": values[-2],
            "truncated_fraction": sums.get("truncated", 0.0) / tokens,
            "clipped_fraction": sums.get("clipped", 0.0) / tokens,
            "negative_logp": sums.get("negative_logp", 0.0) / tokens,
            "advantage_abs_mean": float(advantages.abs().mean()) if len(trajs) else 0.0,
            "lr": lr,
            "micro_batches": float(len(chunks)),
            "train_seconds": time.perf_counter() - started,
        }
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / tokens
        return metrics

    _staging: ShareStaging | None = None  # this rank's reusable export buffers

    def weights(self, version: int) -> ShardedWeights:
        """This rank's share of the version: its own dim-0 shard of every parameter (no gather:
        peak extra memory is the shard), cast to ``trainer.export_dtype``, placed by its offset in
        the full tensor; replicated tensors come from rank 0. Every rank pushes its share
        (``push_shards``). The copy goes into reusable host buffers (pinned, on a side stream
        with CUDA) and overlaps the next step, which waits for it only before its optimizer step
        writes the parameters (``staleflow.training.export``)."""
        if self._staging is None:
            staging = self._staging = ShareStaging(self.rank, self.world, export_dtype(self.cfg.export_dtype), self.device)
            self.optimizer.register_step_pre_hook(lambda *_: staging.before_update())
        drop = ("lm_head.weight",) if self.tied else ()
        return self._staging.export(local_shards(self.model.state_dict(), self.rank, drop))

    def push_shards(self, version: int, params_url: str) -> None:
        """Ranks > 0: snapshot this rank's share and push it in the background, seen through to
        visible (rank 0's trainer role pushes its own share and waits for the version to be
        visible). One push at a time: this waits for the previous version to be visible first,
        and the last share is kept until the PS persisted it (``BackgroundSharePushes``)."""
        if self._pushes is None or self._pushes.url != params_url:
            self.stop_pushes()
            self._pushes = BackgroundSharePushes(params_url, self.rank, remote_push=self.cfg.remote_push)
        self._pushes.wait()  # before the snapshot: the previous share may go meanwhile
        self._pushes.submit(version, self.weights(version))

    def stop_pushes(self) -> None:
        if self._pushes is not None:
            self._pushes.close()
            self._pushes = None

    def checkpoint(self, version: int) -> bool:
        if version % self.cfg.checkpoint_every and version != self.final_version:
            return False
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        target = self.checkpoint_dir / f"step-{version:06d}"
        # save and load are torch.distributed.checkpoint's API, re-exported without an __all__ entry
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))  # pyright: ignore[reportPrivateImportUsage]
        dist.barrier()
        if self.rank == 0:
            latest = self.checkpoint_dir / "latest.json"
            tmp = latest.with_suffix(".tmp")
            tmp.write_text(json.dumps({"version": version, "path": target.name}))
            os.replace(tmp, latest)  # the checkpoint exists once this names it
            kept = sorted(p for p in self.checkpoint_dir.glob("step-*") if p.is_dir())
            for old in kept[:-CHECKPOINTS_KEPT]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return True

    # -- internals -----------------------------------------------------------------------

    def _load_checkpoint(self) -> int:
        latest = self.checkpoint_dir / "latest.json"
        if not latest.exists():
            return 0
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        info = json.loads(latest.read_text())
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(self.checkpoint_dir / info["path"]))  # pyright: ignore[reportPrivateImportUsage]
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        log.info("rank %d resumed from checkpoint %s (version %d)", self.rank, info["path"], info["version"])
        return int(info["version"])

    def _micro_batches(self, trajs: list[Mapping[str, Any]], mine: list[int]) -> list[list[int]]:
        """This rank's trajectories in micro-batches: ``algorithm.micro_batch`` at a time, or by
        token budget (``max_tokens_per_micro_batch``, resolved: packed, or padded rows within the budget)."""
        budget = self.token_budget
        if budget is None:
            return row_count_batches({i: len(trajs[i]["prompt_ids"]) + len(trajs[i]["tokens"]) for i in mine},
                                     self.algo.micro_batch)
        longest_prompt = max((len(trajs[i]["prompt_ids"]) for i in mine), default=0)
        if longest_prompt >= budget:
            resolved = " (auto, from the memory model)" if self.cfg.max_tokens_per_micro_batch == "auto" else ""
            raise ValueError(f"trainer.max_tokens_per_micro_batch is {budget} tokens{resolved} but a prompt has "
                             f"{longest_prompt}: set it above the longest prompt plus a response (at least "
                             f"{longest_prompt + 1})")
        return token_budget_batches({i: len(trajs[i]["prompt_ids"]) + len(trajs[i]["tokens"]) for i in mine},
                                    budget, packed=self.packing)

    def _tensors(self, rows: list[Mapping[str, Any]], live: bool) -> tuple[Any, ...]:
        """The model's inputs (packed into one row with restarting position ids, or right-padded
        rows with no attention mask: causal attention never lets a real token see the pads after
        it), what the log-prob head sees (``HeadInputs``: the response positions only), and the
        per-position (shifted) response mask and behaviour log-probs, [rows, width - 1]."""
        lengths = [len(r["prompt_ids"]) + len(r["tokens"]) for r in rows]
        width = max(lengths)
        mask = torch.zeros((len(rows), width - 1))
        behaviour = torch.zeros((len(rows), width - 1))
        sequences = [list(r["prompt_ids"]) + list(r["tokens"]) for r in rows]
        starts = list(itertools.accumulate([0, *lengths[:-1]])) if self.packing else [i * width for i in range(len(rows))]
        positions: list[int] = []
        targets: list[int] = []
        slots: list[int] = []
        for i, r in enumerate(rows):
            p, t = len(r["prompt_ids"]), len(r["tokens"])
            if live:  # position j predicts token j + 1: the response starts at p - 1
                mask[i, p - 1:p - 1 + t] = 1
                behaviour[i, p - 1:p - 1 + t] = torch.tensor(r["logprobs"], dtype=torch.float32)
                positions += range(starts[i] + p - 1, starts[i] + p - 1 + t)
                targets += r["tokens"]
                slots += range(i * (width - 1) + p - 1, i * (width - 1) + p - 1 + t)
        if not positions:  # an empty share still runs the head (masked out) so the collectives line up
            positions, targets, slots = [starts[0]], [sequences[0][1]], [0]
        inputs: dict[str, Any]
        if self.packing:
            inputs = {"input_ids": torch.tensor([x for seq in sequences for x in seq])[None],
                      "position_ids": torch.cat([torch.arange(n) for n in lengths])[None], **packed_inputs(lengths)}
        else:
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            for i, seq in enumerate(sequences):
                ids[i, :lengths[i]] = torch.tensor(seq)
            inputs = {"input_ids": ids}
        to = self._to_device
        head = HeadInputs(to(torch.tensor(positions)), to(torch.tensor(targets)), to(torch.tensor(slots)), mask.shape)
        return {k: to(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, head, to(mask), to(behaviour)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor to the device without waiting for the device's queued work (pinned)."""
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _token_logp(self, model: PreTrainedModel, inputs: Mapping[str, torch.Tensor], head: HeadInputs) -> torch.Tensor:
        """Each position's log-prob of the next token, [rows, width - 1], through the chunked (or
        fused) output head, which sees the response positions only (0 elsewhere: masked out)."""
        with head_returns_logprobs(model, head.targets, self.chunk_tokens, self.settings.fused_logprobs,
                                   positions=head.positions, timer=self.head_timer):
            picked = model(**inputs).logits
        flat = torch.zeros(head.shape.numel(), dtype=picked.dtype, device=picked.device)
        return flat.index_copy(0, head.slots, picked).view(head.shape)


@dataclass(frozen=True)
class HeadInputs:
    """What the log-prob head computes: at ``positions`` (indices into the model's flattened
    positions) the log-prob of ``targets``, written to ``slots`` of the flattened [rows, width - 1]
    per-position tensors (``shape``)."""

    positions: torch.Tensor
    targets: torch.Tensor
    slots: torch.Tensor
    shape: torch.Size


@dataclass(frozen=True)
class ResolvedSettings:
    """The trainer's ``auto`` settings resolved for the device it runs on."""

    mixed_precision: bool
    activation_checkpointing: CheckpointingPolicy
    fused_logprobs: bool
    logprob_chunk_tokens: int | str
    compile: bool


def resolve_settings(cfg: TrainerConfig, device: torch.device) -> ResolvedSettings:
    cuda = device.type == "cuda"

    def pick(value: bool | str, auto: bool) -> bool:
        return auto if value == "auto" else bool(value)

    fused = pick(cfg.fused_logprobs, liger_available(device))
    if fused and not liger_available(device):
        raise ValueError("trainer.fused_logprobs needs CUDA and liger_kernel (pip install 'staleflow[liger]'); "
                         "set it to auto or false for the chunked head")
    fused_kernels_for(cfg.fused_kernels, device, None, cfg.compile)  # refused here, before a model is built
    return ResolvedSettings(mixed_precision=pick(cfg.mixed_precision, cuda),
                            activation_checkpointing=checkpointing_for(cfg.activation_checkpointing, device),
                            fused_logprobs=fused,
                            logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                            compile=cfg.compile)


def row_count_batches(lengths: Mapping[int, int], size: int) -> list[list[int]]:
    """The given rows (id -> tokens) in as few micro-batches of at most ``size`` rows as there can
    be, rows of like length together. Right-padded, a micro-batch costs its row count times its
    longest row, so the rows go longest first and the one short micro-batch sits where it saves
    the most (a long-tail batch in arrival order pads nearly every micro-batch to the longest row)."""
    order = sorted(lengths, key=lambda r: (-lengths[r], r))
    if not order:
        return []
    count = -(-len(order) // size)
    short = len(order) - (count - 1) * size

    def sizes_with_short_at(position: int) -> list[int]:
        return [short if b == position else size for b in range(count)]

    def padded_cost(sizes: list[int]) -> int:
        return sum(n * lengths[order[start]] for start, n in zip(itertools.accumulate([0, *sizes[:-1]]), sizes, strict=True))

    sizes = min((sizes_with_short_at(b) for b in range(count)), key=padded_cost)
    return [sorted(order[start:start + n]) for start, n in zip(itertools.accumulate([0, *sizes[:-1]]), sizes, strict=True)]


def token_budget_batches(lengths: Mapping[int, int], budget: int, packed: bool) -> list[list[int]]:
    """Micro-batches of the given rows (id -> tokens) within ``budget`` tokens each, longest
    first: packed, a batch costs the sum of its lengths; padded, its row count times its longest
    row. A row longer than the budget is a micro-batch alone."""
    batches: list[list[int]] = []
    cost: list[tuple[int, int]] = []  # (total tokens, longest row) of each batch
    for row in sorted(lengths, key=lambda r: (-lengths[r], r)):
        n = lengths[row]
        for b, (total, longest) in enumerate(cost):
            new_cost = total + n if packed else (len(batches[b]) + 1) * max(longest, n)
            if new_cost <= budget:
                batches[b].append(row)
                cost[b] = (total + n, max(longest, n))
                break
        else:
            batches.append([row])
            cost.append((n, n))
    return [sorted(b) for b in batches]


# ---------------------------------------------------------------------------- ranks


class RankDriver(TrainerBackend):
    """Rank 0's view: each call is broadcast to the other ranks, then run on this rank's shard."""

    def __init__(self, local: FsdpBackend, params_url: str | None = None):
        self.local = local
        self.label = local.label
        self.params_url = params_url

    def _all(self, op: str, *args: Any) -> Any:
        dist.broadcast_object_list([(op, args)], src=0)
        return getattr(self.local, op)(*args)

    def resume_version(self) -> int | None:
        return self.local.resume_version()

    def train(self, version: int, batch: Mapping[str, Any]) -> dict[str, float]:
        return self._all("train", version, batch)

    def weights(self, version: int) -> ShardedWeights:
        if self.params_url is None:
            raise RuntimeError("RankDriver needs the parameter server's URL: every rank pushes its own shards")
        dist.broadcast_object_list([("push_shards", (version, self.params_url))], src=0)
        return self.local.weights(version)

    def checkpoint(self, version: int) -> bool:
        return self._all("checkpoint", version)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.broadcast_object_list([("stop", ())], src=0)


def follow(local: FsdpBackend) -> None:
    """Ranks > 0: run what rank 0 broadcasts until it says stop."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        op, args = message[0]
        if op == "stop":
            local.stop_pushes()  # rank 0 saw the last version visible, or the trainer is stopping
            return
        getattr(local, op)(*args)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):  # Linux: a SIGKILLed rank 0 takes its followers with it
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def rendezvous_from_env() -> tuple[str, int, int, int] | None:
    """(master address, master port, rank, world size) when a launcher set all four in the
    environment (the Ray launcher does, one actor per rank), else None."""
    if not all(os.environ.get(k) for k in RENDEZVOUS_ENV):
        return None
    return (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]))


def local_gpu(rank: int) -> int:
    """This rank's GPU among those it sees: ``LOCAL_RANK`` when a launcher set it; else the rank
    when it sees a GPU for every rank up to it (the trainer's own spawn: all ranks on one node);
    else GPU 0 of the one it was given (Ray sets ``CUDA_VISIBLE_DEVICES`` per actor)."""
    gpus = torch.cuda.device_count()
    if "LOCAL_RANK" in os.environ:
        local = int(os.environ["LOCAL_RANK"])
    else:
        local = rank if rank < gpus or gpus != 1 else 0
    check_gpus_for_ranks(local + 1)
    return local


def check_gpus_for_ranks(ranks_on_node: int) -> None:
    """One rank per GPU: more ranks on this node than GPUs is refused before anything starts."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and ranks_on_node > gpus:
        raise ValueError(f"{ranks_on_node} trainer ranks on this node but only {gpus} GPUs: one rank per GPU; set "
                         f"trainer.world_size (--trainer-ranks) to at most {gpus} per node, or add nodes")


def init_process_group(rank: int, world: int, port: int, master_addr: str = "127.0.0.1") -> None:
    """gloo on CPU; on GPU one device per rank with NCCL for tensors on it and gloo beside it for
    host tensors, so Python objects (``broadcast_object_list``, barriers) go through gloo."""
    os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)})
    if master_addr.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one machine: the loopback interface; else the configured one
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_gpu(rank))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)


def run_follower(rank: int, world: int, port: int, role_json: str) -> None:
    """Rank ``rank`` (> 0) of a trainer whose rank 0 spawned it, with the role's section (JSON)."""
    _die_with_parent()
    role = TrainerRoleConfig.model_validate_json(role_json)
    assert role.model_dir is not None, "an FSDP2 trainer role names its model"
    init_process_group(rank, world, port)
    try:
        follow(FsdpBackend(role.trainer, role.model_dir, role.checkpoint_dir, rank, world, role.steps))
    finally:
        dist.destroy_process_group()
