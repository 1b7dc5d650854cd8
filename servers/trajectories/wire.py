"""The trajectory server's side of its contract (``staleflow.api.trajectories``): the JSON it serves
for a trajectory, rendered from its store's records."""

from __future__ import annotations

from staleflow.config import SamplingConfig
from staleflow.servers.trajectories.store import GroupRecord, TrajRecord, prompt_key


def traj_payload(t: TrajRecord, g: GroupRecord, sampling: SamplingConfig) -> dict:
    """The trajectory as an instance's Route command carries it."""
    return {
        "traj_id": t.traj_id,
        "group_id": g.group_id,
        "prompt_ids": list(g.prompt_ids),
        "v_traj": g.v_traj,
        "sampling": {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p},
        "tokens": list(t.tokens),
        "logprobs": list(t.logprobs),
        "segments": [{"version": v, "start": s, "end": e} for v, s, e in t.segments],
    }


def summary(t: TrajRecord, g: GroupRecord) -> dict:
    return {"traj_id": t.traj_id, "group_id": g.group_id, "state": t.state.value, "v_traj": g.v_traj,
            "length": len(g.prompt_ids) + len(t.tokens), "generated": len(t.tokens), "instance_id": t.instance_id,
            "seq": t.seq, "prompt_key": prompt_key(g)}
