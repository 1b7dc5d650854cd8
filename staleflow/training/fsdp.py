"""The FSDP2 trainer: GRPO/DAPO on a Hugging Face causal LM, sharded with ``fully_shard``.

Rank 0 runs the trainer role (``TrainerLoop``: consume, fetch, push, free; its process
orchestration is ``staleflow.servers.trainer.run_fsdp_trainer``) with a ``RankDriver`` backend
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
import json
import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from staleflow.config import JobConfig, TrainerConfig
from staleflow.training.base import BackgroundSharePushes, ShardedWeights, TrainerBackend
from staleflow.training.grpo import group_advantages, policy_loss
from staleflow.training.schedule import learning_rate

log = logging.getLogger(__name__)

CHECKPOINTS_KEPT = 2


class FsdpBackend(TrainerBackend):
    """One rank's shard of the policy, its optimizer and its checkpoints."""

    def __init__(self, cfg: TrainerConfig, model_dir: Path, checkpoint_dir: Path, rank: int, world: int,
                 final_version: int):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        self.cfg, self.algo = cfg, cfg.algorithm
        self.rank, self.world = rank, world
        self.checkpoint_dir = checkpoint_dir
        self.final_version = final_version
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(0)
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.mixed_precision
              else MixedPrecisionPolicy())

        def sharded(trainable: bool) -> torch.nn.Module:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
            model.config.use_cache = False
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            model.train(trainable)
            model.requires_grad_(trainable)
            return model

        self.model = sharded(True)
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.pad_id = self.model.config.pad_token_id or 0
        self.reference = sharded(False) if self.algo.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.algo.lr, weight_decay=self.algo.weight_decay)
        self.version = self._load_checkpoint()
        self._pushes: BackgroundSharePushes | None = None  # ranks > 0: their shares, one version at a time

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
        per_rank = math.ceil(len(trajs) / self.world)
        micro = max(1, math.ceil(per_rank / self.algo.micro_batch))
        totals: dict[str, torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        for m in range(micro):
            chunk = mine[m * self.algo.micro_batch:(m + 1) * self.algo.micro_batch]
            rows = [trajs[i] for i in chunk] or [trajs[0]]  # an empty share still joins the collectives
            ids, attention, mask, behaviour = self._tensors(rows, live=bool(chunk))
            logp = self._token_logp(self.model, ids, attention)
            reference = None
            if self.reference is not None:
                with torch.no_grad():
                    reference = self._token_logp(self.reference, ids, attention)
            adv = advantages[chunk] if chunk else torch.zeros(1)
            terms = policy_loss(logp, behaviour, adv.to(self.device), mask, self.algo, global_tokens=global_tokens,
                                global_sequences=float(len(trajs)), reference=reference)
            (terms.loss * self.world).backward()  # FSDP averages gradients over ranks: undo it
            loss_sum += terms.loss.detach().double().cpu()
            for k, v in terms.stats.items():
                v = v.detach().double().cpu()
                totals[k] = torch.maximum(totals[k], v) if k.endswith("_max") and k in totals else totals.get(k, 0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.algo.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = learning_rate(self.algo, version, self.final_version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version = version + 1
        summed = torch.stack([loss_sum, *(totals[k] for k in sorted(totals) if not k.endswith("_max"))])
        maxima = torch.stack([totals[k] for k in sorted(totals) if k.endswith("_max")] or [torch.zeros((), dtype=torch.float64)])
        dist.all_reduce(summed)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        names = [k for k in sorted(totals) if not k.endswith("_max")]
        sums = dict(zip(names, summed[1:].tolist(), strict=True))
        tokens = max(sums.get("tokens", 0.0), 1.0)
        metrics = {
            "loss": float(summed[0]),
            "grad_norm": float(grad_norm),
            "importance_weight_mean": sums.get("importance_weight", 0.0) / tokens,
            "importance_weight_max": float(maxima[0]),
            "truncated_fraction": sums.get("truncated", 0.0) / tokens,
            "clipped_fraction": sums.get("clipped", 0.0) / tokens,
            "negative_logp": sums.get("negative_logp", 0.0) / tokens,
            "advantage_abs_mean": float(advantages.abs().mean()) if len(trajs) else 0.0,
            "lr": lr,
            "train_seconds": time.perf_counter() - started,
        }
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / tokens
        return metrics

    def weights(self, version: int) -> ShardedWeights:
        """This rank's share of the version: a host copy of its own dim-0 shard of every
        parameter (no gather: peak extra memory is the shard), placed by its offset in the full
        tensor; replicated tensors come from rank 0. Every rank pushes its share (``push_shards``)."""
        return sharded_weights(self.model.state_dict(), self.rank, self.world, drop=("lm_head.weight",) if self.tied else ())

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
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))
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
        dcp.load(state, checkpoint_id=str(self.checkpoint_dir / info["path"]))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        log.info("rank %d resumed from checkpoint %s (version %d)", self.rank, info["path"], info["version"])
        return int(info["version"])

    def _tensors(self, rows: list[Mapping[str, Any]], live: bool) -> tuple[torch.Tensor, ...]:
        """Right-padded prompt+response ids, attention, and per-position (shifted) response mask
        and behaviour log-probs."""
        width = max(len(r["prompt_ids"]) + len(r["tokens"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width - 1))
        behaviour = torch.zeros((len(rows), width - 1))
        for i, r in enumerate(rows):
            p, t = len(r["prompt_ids"]), len(r["tokens"])
            ids[i, :p + t] = torch.tensor(list(r["prompt_ids"]) + list(r["tokens"]))
            attention[i, :p + t] = 1
            if live:  # position j predicts token j + 1: the response starts at p - 1
                mask[i, p - 1:p - 1 + t] = 1
                behaviour[i, p - 1:p - 1 + t] = torch.tensor(r["logprobs"], dtype=torch.float32)
        return ids.to(self.device), attention.to(self.device), mask.to(self.device), behaviour.to(self.device)

    @staticmethod
    def _token_logp(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


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


def sharded_weights(state: Mapping[str, Any], rank: int, world: int, drop: tuple[str, ...] = ()) -> ShardedWeights:
    """This rank's share of a (possibly DTensor) state dict: its dim-0 shard of each sharded
    tensor as a byte range of the full tensor, and the replicated tensors on rank 0."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from staleflow.transports.client import ShardPiece, safetensors_dtype_of

    share = ShardedWeights(rank, world, {})
    for name, value in state.items():
        if name in drop:
            continue
        full_shape = tuple(value.shape)
        share.tensors[name] = (safetensors_dtype_of(value), full_shape)
        if isinstance(value, DTensor):
            placements = tuple(value.placements)
            if any(not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and p.dim != 0) for p in placements):
                raise ValueError(f"{name}: placements {placements} are not dim-0 shards; cannot push it without a gather")
            if not any(isinstance(p, Shard) for p in placements):
                if rank == 0:
                    share.pieces.append(ShardPiece(name, 0, value.to_local().detach().to("cpu", copy=True).contiguous()))
                continue
            local_shape, offset = compute_local_shape_and_global_offset(full_shape, value.device_mesh, placements)
            local = value.to_local().detach()
            if tuple(local.shape) != tuple(local_shape):  # padded storage: keep the real rows only
                local = local[: local_shape[0]]
            if local.numel() == 0:
                continue
            row_bytes = local.element_size() * (math.prod(full_shape[1:]) if len(full_shape) > 1 else 1)
            share.pieces.append(ShardPiece(name, offset[0] * row_bytes, local.to("cpu", copy=True).contiguous()))
        elif rank == 0:
            share.pieces.append(ShardPiece(name, 0, value.detach().to("cpu", copy=True).contiguous()))
    return share


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


def init_process_group(rank: int, world: int, port: int, master_addr: str = "127.0.0.1") -> None:
    os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)})
    if master_addr.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one machine: the loopback interface; else the configured one
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world)


def run_follower(rank: int, world: int, port: int, config_json: str, model_dir: str) -> None:
    _die_with_parent()
    config = JobConfig.model_validate_json(config_json)
    init_process_group(rank, world, port)
    try:
        follow(FsdpBackend(config.trainer, Path(model_dir), checkpoint_dir(config), rank, world, config.steps))
    finally:
        dist.destroy_process_group()


def checkpoint_dir(config: JobConfig) -> Path:
    return config.state_dir / "trainer" / "checkpoints"
