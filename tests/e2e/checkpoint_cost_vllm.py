"""What progress checkpoints cost an instance on the vLLM CPU engine: rollout throughput with
checkpoints on (the default interval) against off, side by side.

Two instance servers (``staleflow serve instance --engine vllm``), each a process of its own on the
same tiny random Qwen2, identical but for ``--progress-url``: one checkpoints to a stand-in
trajectory server on loopback, the other does not. Phases alternate between them (on, off, off,
on, ...), so only one generates at a time and drift in the machine's load falls on both alike;
each phase routes the same trajectories (``ignore_eos``, fixed length) and ends when the last
completion arrives. Not a test (nothing is asserted): run it by hand where vLLM is installed::

    .venv/bin/python tests/e2e/checkpoint_cost_vllm.py --pairs 4 --trajectories 16 --tokens 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from support import free_port, start_cli  # noqa: E402
from test_vllm_engine import PROMPT, build_tiny_qwen2  # noqa: E402  (sets vLLM's offline environment)

from staleflow.servers.http import serve_in_thread  # noqa: E402


class StandIn:
    """The trajectory server's two routes an instance calls: completions (counted per instance)
    and progress checkpoints (kept as a real one would: each continues what is held)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.completed: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.checkpoints = 0
        self.app = FastAPI()
        self.app.post("/v1/completed")(self.on_completed)
        self.app.post("/v1/progress")(self.on_progress)

    async def on_completed(self, request: Request) -> dict:
        body = await request.json()
        with self.lock:
            for item in body["items"]:
                instance = item.get("instance_id") or body["instance_id"]
                self.completed[instance] = self.completed.get(instance, 0) + 1
        return {"accepted": len(body["items"])}

    async def on_progress(self, request: Request) -> dict:
        body = await request.json()
        stored = {}
        with self.lock:
            self.checkpoints += 1
            for p in body["trajectories"]:
                have = self.held.get(p["traj_id"], 0)
                if p["start"] <= have:
                    self.held[p["traj_id"]] = max(have, p["start"] + len(p["tokens"]))
                stored[p["traj_id"]] = self.held.get(p["traj_id"], 0)
        return {"stored": stored, "ignored": []}

    def count(self, instance: str) -> int:
        with self.lock:
            return self.completed.get(instance, 0)


def phase(client: httpx.Client, stand_in: StandIn, instance: str, tag: str, trajectories: int, tokens: int) -> float:
    """Route ``trajectories`` of ``tokens`` response tokens; tokens per second until the last completes."""
    before = stand_in.count(instance)
    route = {"command_id": f"route-{tag}", "kind": "route", "trajectories": [
        {"traj_id": f"{tag}/{i}", "group_id": tag, "prompt_ids": list(PROMPT), "v_traj": 0,
         "sampling": {"max_tokens": tokens, "ignore_eos": True, "temperature": 0.0}}
        for i in range(trajectories)]}
    started = time.monotonic()
    reply = client.post("/v1/commands", json=route)
    reply.raise_for_status()
    deadline = started + 1800
    while stand_in.count(instance) < before + trajectories:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{instance}: phase {tag} did not finish")
        time.sleep(0.02)  # polling pacing
    return trajectories * tokens / (time.monotonic() - started)


def wait_until_up(client: httpx.Client, deadline_s: float = 900.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            if client.get("/v1/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{client.base_url} did not start")
        time.sleep(0.5)  # polling pacing while the engine starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="on/off phase pairs (alternating order)")
    parser.add_argument("--trajectories", type=int, default=16, help="trajectories routed per phase")
    parser.add_argument("--tokens", type=int, default=1000, help="response tokens per trajectory")
    parser.add_argument("--warmup-tokens", type=int, default=64, help="one untimed phase per instance first")
    parser.add_argument("--output", type=Path, help="write the phases and the summary here (JSON)")
    args = parser.parse_args()

    model = Path(tempfile.mkdtemp(prefix="staleflow-ckpt-cost-")) / "tiny"
    build_tiny_qwen2(model, seed=0)
    stand_in = StandIn()
    procs = []
    with serve_in_thread(stand_in.app) as ts:
        try:
            urls = {}
            for name, progress in (("on", True), ("off", False)):
                port = free_port()
                procs.append(start_cli(
                    "serve", "instance", "--engine", "vllm", "--instance-id", name, "--port", str(port),
                    "--model", str(model), "--dtype", "float32", "--max-model-len", str(len(PROMPT) + args.tokens + 8),
                    "--vllm-set", "kv_cache_gib=1", "--callback-url", f"{ts.url}/v1/completed",
                    *(["--progress-url", f"{ts.url}/v1/progress"] if progress else []), "--log-level", "warning"))
                urls[name] = f"http://127.0.0.1:{port}"
            clients = {name: httpx.Client(base_url=url, timeout=60) for name, url in urls.items()}
            for name, client in clients.items():
                wait_until_up(client)
                phase(client, stand_in, name, f"warmup-{name}", args.trajectories, args.warmup_tokens)
            rates: dict[str, list[float]] = {"on": [], "off": []}
            phases = []
            for pair in range(args.pairs):
                for name in (("on", "off") if pair % 2 == 0 else ("off", "on")):
                    load = os.getloadavg()[0]
                    rate = phase(clients[name], stand_in, name, f"{name}-{pair}", args.trajectories, args.tokens)
                    rates[name].append(rate)
                    phases.append({"pair": pair, "checkpoints": name, "tokens_per_s": rate, "load_before": load})
                    print(f"pair {pair} checkpoints {name}: {rate:,.0f} tokens/s (load {load:.1f})", flush=True)
            progress = clients["on"].get("/v1/progress").json()
            for client in clients.values():
                client.close()
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(60)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    summary = {
        "trajectories": args.trajectories, "tokens": args.tokens, "pairs": args.pairs,
        "on_tokens_per_s": rates["on"], "off_tokens_per_s": rates["off"],
        "ratio_per_pair": ratios, "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ratio_of_sums": sum(rates["on"]) / sum(rates["off"]),
        "off_spread": (max(rates["off"]) - min(rates["off"])) / statistics.median(rates["off"]),
        "on_spread": (max(rates["on"]) - min(rates["on"])) / statistics.median(rates["on"]),
        "checkpoint_batches": stand_in.checkpoints,
        "instance_progress": {k: v for k, v in progress.items() if k not in ("held", "checkpointed")},
    }
    print(json.dumps(summary, indent=2))
    if args.output:
        args.output.write_text(json.dumps({"phases": phases, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
