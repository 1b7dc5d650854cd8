"""The run report of a job: a JSON summary and plots (paper Figures 17 and 18, throughput)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any


def summarize(config: Any, steps: Sequence[Any], samples: Sequence[Any], engine_stats: dict[str, dict],
              command_seconds: dict[str, float], wall_seconds: float, trainer_label: str) -> dict:
    """Everything a person looks at after a run, as one JSON-able document."""
    eta = config.ledger.eta
    tokens = sum(s.response_tokens for s in steps)
    simulated = wall_seconds * config.speed if config.engine == "sim" else wall_seconds
    staleness_per_buffer = {str(s.version): {str(k): v for k, v in sorted(s.staleness.items())} for s in steps}
    violations = sum(n for s in steps for k, n in s.staleness.items() if not 0 <= k <= eta)
    breakdown = {key: sum(st.get(f"{key}_seconds", 0.0) for st in engine_stats.values() if st.get("available"))
                 for key in ("decode", "prefill", "pull")}
    for kind in ("route", "interrupt"):  # real HTTP command time, on the simulated time scale
        breakdown[kind] = command_seconds.get(kind, 0.0) * (config.speed if config.engine == "sim" else 1.0)
    total = sum(breakdown.values()) or 1.0
    return {
        "engine": config.engine,
        "trainer": trainer_label,
        "steps": len(steps),
        "eta": eta,
        "batch_size": config.ledger.batch_size,
        "group_size": config.ledger.group_size,
        "instances": config.instances,
        "strategies": {"routing": config.routing, "sync": config.sync, "migration": config.migration},
        "wall_seconds": wall_seconds,
        "simulated_seconds": simulated,
        "response_tokens": tokens,
        "tokens_per_second": tokens / simulated if simulated else 0.0,
        "clock": f"sim time = wall time x {config.speed}" if config.engine == "sim" else "wall time",
        "time_breakdown_seconds": breakdown,
        "time_breakdown_share": {k: v / total for k, v in breakdown.items()},
        "mean_decision_ms": command_seconds.get("mean_decision_ms", 0.0),
        "staleness_per_buffer": staleness_per_buffer,
        "staleness_violations": violations,
        "per_step": [asdict(s) for s in steps],
    }


def write_report(directory: Path, summary: dict, samples: Sequence[Any]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    return [directory / "summary.json", *plot(directory, summary, samples)]


def plot(directory: Path, summary: dict, samples: Sequence[Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # Figure 17: per-instance running / waiting trajectories over time, with sync marks
    ids = sorted({i for s in samples for i in s.instances})
    if ids:
        fig, axes = plt.subplots(len(ids), 1, figsize=(10, 1.6 * len(ids) + 1), sharex=True, squeeze=False)
        for ax, inst in zip(axes[:, 0], ids, strict=True):
            ts = [s.t for s in samples if inst in s.instances]
            run = [s.instances[inst]["running"] for s in samples if inst in s.instances]
            wait = [s.instances[inst]["waiting"] for s in samples if inst in s.instances]
            versions = [s.instances[inst]["version"] for s in samples if inst in s.instances]
            ax.plot(ts, run, label="running", color="tab:blue")
            ax.plot(ts, wait, label="waiting", color="tab:orange")
            for k in range(1, len(versions)):
                if versions[k] is not None and versions[k - 1] is not None and versions[k] != versions[k - 1]:
                    ax.axvline(ts[k], color="tab:green", linewidth=1)
                    ax.annotate(f"V{versions[k]}", (ts[k], ax.get_ylim()[1] * 0.85), fontsize=7, color="tab:green")
            ax.set_ylabel(inst, rotation=0, ha="right", fontsize=8)
        axes[0, 0].legend(loc="upper right", fontsize=8)
        axes[-1, 0].set_xlabel("wall seconds")
        fig.suptitle("Per-instance load over time (green: model synchronizations)")
        fig.tight_layout()
        written.append(directory / "instance_load.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    # Figure 18: staleness distribution per buffer
    per_buffer = summary["staleness_per_buffer"]
    if per_buffer:
        versions = sorted(per_buffer, key=int)
        levels = sorted({int(k) for d in per_buffer.values() for k in d})
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(versions) + 3), 4))
        bottom = [0] * len(versions)
        for level in levels:
            counts = [per_buffer[v].get(str(level), 0) for v in versions]
            ax.bar(versions, counts, bottom=bottom, label=f"staleness {level}")
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        ax.set_xlabel("buffer (trainer version)")
        ax.set_ylabel("trajectories")
        ax.set_title(f"Staleness V_buf - V_traj per buffer (bound eta = {summary['eta']})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(directory / "staleness.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    # throughput over time
    steps = summary["per_step"]
    if len(steps) >= 1:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        t_prev, xs, ys = 0.0, [], []
        for s in steps:
            dt = max(1e-9, s["finished_at"] - t_prev)
            xs.append(s["finished_at"])
            ys.append(s["response_tokens"] / dt)
            t_prev = s["finished_at"]
        ax.plot(xs, ys, marker="o")
        ax.set_xlabel("wall seconds")
        ax.set_ylabel("trained tokens / wall second")
        ax.set_title("Throughput per training step")
        fig.tight_layout()
        written.append(directory / "throughput.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if steps and summary.get("engine") != "sim":  # the sim reward is a coin flip: nothing to plot
        written.append(plot_rewards(directory / "reward.png", {f"eta = {summary['eta']}": steps}))
    return written


def plot_rewards(path: Path, runs: dict[str, Sequence[dict]]) -> Path:
    """Mean reward per training step (and its moving average over 5 steps), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4))
    for label, steps in runs.items():
        xs = [s["version"] for s in steps]
        ys = np.array([s["mean_reward"] for s in steps])
        line = ax.plot(xs, ys, alpha=0.35, marker=".")[0]
        if len(ys) >= 5:
            smooth = np.convolve(ys, np.ones(5) / 5, mode="valid")
            ax.plot(xs[4:], smooth, color=line.get_color(), label=f"{label} (5-step mean)")
        else:
            line.set_label(label)
    ax.set_xlabel("training step (trainer version)")
    ax.set_ylabel("mean reward of the batch")
    ax.set_title("Reward over training")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_staleness_convergence(path: Path, runs: Sequence[dict]) -> Path:
    """The paper's Figure 14: mean reward of the batch against the training step (left) and
    against wall-clock time (right), one line per run (``staleflow.experiments.run_numbers``
    documents), its tokens/s in the legend; the run without a bound is dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for run in runs:
        ys = np.array(run["rewards"])
        style = "-" if run["bounded"] else "--"
        label = f"{run['label']}: {run['tokens_per_second']:,.0f} tokens/s"
        line = by_step.plot(range(len(ys)), ys, style, marker=".", alpha=0.8, label=label)[0]
        by_time.plot(run["finished_at"], ys, style, marker=".", alpha=0.8, color=line.get_color(), label=label)
    by_step.set_xlabel("training step")
    by_step.set_ylabel("mean reward of the trained batch")
    by_time.set_xlabel("wall-clock seconds since the job started")
    by_step.set_title("reward vs step")
    by_time.set_title("reward vs time")
    by_time.legend(fontsize=8, loc="best")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
