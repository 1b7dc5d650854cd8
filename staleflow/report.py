"""The run report of a job: a JSON summary and plots (paper Figures 17 and 18, throughput, the
lengths trained against those generated) and the length-skew table (``length_skew.md``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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
    scale = config.speed if config.engine == "sim" else 1.0  # command latency on the engine's time scale
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
        "time_breakdown": time_breakdown(engine_stats, command_seconds, scale, config.instances),
        "mean_decision_ms": command_seconds.get("mean_decision_ms", 0.0),
        "staleness_per_buffer": staleness_per_buffer,
        "staleness_violations": violations,
        "per_step": [asdict(s) for s in steps],
    }


COMMAND_KINDS = ("route", "interrupt", "abort", "pull", "repack")  # repack: the Interrupts of repack moves


def time_breakdown(engine_stats: dict[str, dict], command_seconds: dict[str, float], scale: float = 1.0,
                   instances: int | None = None) -> dict:
    """The paper's Table 3 from what was measured, each part labelled by where it comes from.

    ``engine``: the instances' own accounting (``/v1/stats``), summed over the instances that
    answered; its parts add up to their rollout time. ``commands``: the coordinator's command
    latencies (issued to answered); they overlap engine time, so they are reported beside it,
    never added to it. An engine that does not account for its time contributes nothing."""
    measured = {name: st for name, st in engine_stats.items() if st.get("available") and "breakdown_seconds" in st}
    engine: dict[str, Any] | None = None
    if measured:
        parts: dict[str, float] = {}
        for st in measured.values():
            for key, value in st["breakdown_seconds"].items():
                parts[key] = parts.get(key, 0.0) + float(value)
        rollout = sum(float(st["rollout_seconds"]) for st in measured.values())
        per_version: dict[str, dict[str, float]] = {}
        for st in measured.values():
            for version, version_parts in (st.get("breakdown_per_version") or {}).items():
                merged = per_version.setdefault(version, {})
                for key, value in version_parts.items():
                    merged[key] = merged.get(key, 0.0) + float(value)
        engine = {
            "source": ", ".join(sorted({str(st.get("source", "engine")) for st in measured.values()})),
            "method": "; ".join(sorted({str(st.get("method", "")) for st in measured.values()} - {""})),
            "instances": len(measured),
            "instances_without_accounting": sorted(set(engine_stats) - set(measured)),
            "rollout_seconds": rollout,
            "seconds": parts,
            "share": {k: v / rollout if rollout else 0.0 for k, v in parts.items()},
            "per_instance": {name: {"rollout_seconds": st["rollout_seconds"], "seconds": st["breakdown_seconds"]}
                             for name, st in sorted(measured.items())},
        }
        if per_version:  # the same parts per model version, summed over instances
            engine["per_version"] = dict(sorted(per_version.items(), key=lambda item: int(item[0])))
    elif instances:
        engine = {"source": "not measured", "instances": 0,
                  "instances_without_accounting": sorted(engine_stats) or [f"{instances} instances"]}
    counts = {kind: int(command_seconds.get(f"{kind}_count", 0)) for kind in COMMAND_KINDS}
    commands = {
        "source": "coordinator command latency (issued to answered, wall clock"
                  + (f", x{scale:g} to the simulated time scale)" if scale != 1.0 else ")"),
        "seconds": {kind: command_seconds.get(kind, 0.0) * scale for kind in COMMAND_KINDS},
        "count": counts,
    }
    return {"engine": engine, "commands": commands}


def write_report(directory: Path, summary: dict, samples: Sequence[Any]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    written = [directory / "summary.json"]
    if summary.get("length_skew"):
        written.append(directory / "length_skew.md")
        written[-1].write_text(length_skew_markdown(summary["length_skew"]))
    return [*written, *plot_job(directory, summary, samples)]


FATE_COLUMNS = ("aborted", "filtered", "dropped")


def _count(counts: dict[str, int]) -> int:
    return sum(counts.values())


def _mean(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def length_skew_line(skew: dict) -> str:
    """The run's length skew in one line, for a console."""
    cut = "/".join(str(_count(skew[f])) for f in FATE_COLUMNS)
    return (f"length skew: mean trained / generated length {_mean(skew['trained_over_generated_mean'], 3)}, "
            f"KS {_mean(skew['ks_distance'], 3)}, W1 {_mean(skew['wasserstein_tokens'])} tokens; "
            f"{_count(skew['trained'])} trained, aborted/filtered/dropped {cut}, "
            f"{_count(skew['regenerated_tokens'])} tokens regenerated; {skew['admission']['waited']} groups waited "
            f"for admission ({skew['admission']['mean_wait_s']:.2f}s mean)")


def length_skew_markdown(skew: dict) -> str:
    """The length-skew accounting (``staleflow.length_skew.LengthSkew.to_json``) as Markdown: the
    run by length bucket, then one row per training step."""
    buckets = sorted({b for key in ("generated", "in_flight") for b in skew[key]}, key=lambda b: int(b.split("-")[0]))
    lines = ["## Length skew: what the staleness bound did to the response lengths", "",
             f"Buckets: {skew['buckets']}. Mean trained / generated length (fate known): "
             f"{_mean(skew['trained_over_generated_mean'], 3)}; KS distance {_mean(skew['ks_distance'], 3)}; "
             f"Wasserstein {_mean(skew['wasserstein_tokens'])} tokens.", "",
             "| length bucket | generated | trained | aborted | filtered | dropped | in flight | regenerated: n (tokens) "
             "| mean staleness |", "|---|---|---|---|---|---|---|---|---|"]
    for b in buckets:
        lines.append(f"| {b} | {skew['generated'].get(b, 0)} | {skew['trained'].get(b, 0)} | "
                     + " | ".join(str(skew[f].get(b, 0)) for f in FATE_COLUMNS)
                     + f" | {skew['in_flight'].get(b, 0)} | {skew['regenerated'].get(b, 0)} "
                       f"({skew['regenerated_tokens'].get(b, 0)}) | {_mean(skew['staleness_mean'].get(b), 2)} |")
    lines += ["", "| step | generated: n (mean len) | trained: n (mean len) | aborted/filtered/dropped | regenerated tokens "
                  "| admitted (waited, mean wait s) |", "|---|---|---|---|---|---|"]
    for step in skew["per_step"]:
        admission = step["admission"]
        lines.append(f"| {step['step']} | {_count(step['generated'])} ({_mean(step['generated_mean'])}) | "
                     f"{_count(step['trained'])} ({_mean(step['trained_mean'])}) | "
                     + "/".join(str(_count(step[f])) for f in FATE_COLUMNS)
                     + f" | {_count(step['regenerated_tokens'])} | {admission['admitted']} ({admission['waited']}, "
                       f"{admission['mean_wait_s']:.2f}) |")
    return "\n".join(lines) + "\n"


def plot_length_skew(path: Path, skew: dict) -> Path | None:
    """Trained against generated response lengths: their CDFs (left) and, by length bucket, what
    became of the generated trajectories with the trained ones' mean staleness (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    generated = {int(k): n for k, n in skew["generated_lengths"].items()}
    trained = {int(k): n for k, n in skew["trained_lengths"].items()}
    if not generated:
        return None
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, counts, style in (("generated", generated, "--"), ("trained", trained, "-")):
        if counts:
            xs = sorted(counts)
            ys = np.cumsum([counts[x] for x in xs]) / sum(counts.values())
            cdf.step(xs, ys, style, where="post", label=f"{label} ({sum(counts.values())}, mean "
                                                         f"{sum(k * n for k, n in counts.items()) / sum(counts.values()):.0f})")
    cdf.set_xscale("symlog", linthresh=1)
    cdf.set_xlabel("response tokens")
    cdf.set_ylabel("share of trajectories at or below")
    cdf.set_title(f"Lengths: KS {_mean(skew['ks_distance'], 3)}, W1 {_mean(skew['wasserstein_tokens'])} tokens "
                  "(against those with a known fate)", fontsize=9)
    cdf.legend(fontsize=8)
    cdf.grid(alpha=0.3)
    buckets = sorted({b for key in ("generated", "in_flight") for b in skew[key]}, key=lambda b: int(b.split("-")[0]))
    bottom = np.zeros(len(buckets))
    colours = {"trained": "tab:blue", "aborted": "tab:red", "filtered": "tab:orange", "dropped": "tab:purple",
               "in_flight": "lightgray"}
    for key, colour in colours.items():
        values = np.array([skew[key].get(b, 0) for b in buckets], dtype=float)
        if values.any():
            bars.bar(range(len(buckets)), values, bottom=bottom, color=colour, label=key.replace("_", " "))
            bottom += values
    bars.set_xticks(range(len(buckets)), buckets, rotation=45, fontsize=7)
    bars.set_xlabel("response length bucket (tokens)")
    bars.set_ylabel("generated trajectories")
    bars.legend(fontsize=7, loc="upper left")
    if skew["staleness_mean"]:
        stale = bars.twinx()
        stale.plot([i for i, b in enumerate(buckets) if b in skew["staleness_mean"]],
                   [skew["staleness_mean"][b] for b in buckets if b in skew["staleness_mean"]], "k.-")
        stale.set_ylabel("mean staleness of the trained (black)")
    bars.set_title("What became of each length bucket", fontsize=9)
    fig.suptitle("Trained against generated response lengths")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_job(directory: Path, summary: dict, samples: Sequence[Any]) -> list[Path]:
    """Every figure of a job's report that its summary and samples have data for."""
    figures = [
        plot_instance_load(directory / "instance_load.png", samples),
        plot_staleness_per_buffer(directory / "staleness.png", summary["staleness_per_buffer"], summary["eta"]),
        plot_throughput(directory / "throughput.png", summary["per_step"]),
    ]
    written = [path for path in figures if path is not None]
    if summary.get("time_breakdown"):
        path = plot_time_breakdown(directory / "time_breakdown.png", summary["time_breakdown"])
        if path is not None:
            written.append(path)
        per_version = (summary["time_breakdown"].get("engine") or {}).get("per_version")
        if per_version:
            written.append(plot_time_per_version(directory / "time_per_version.png", per_version,
                                                 summary["time_breakdown"]["engine"]["source"]))
    if summary.get("length_skew"):
        path = plot_length_skew(directory / "length_skew.png", summary["length_skew"])
        if path is not None:
            written.append(path)
    steps = summary["per_step"]
    if steps and summary.get("engine") != "sim":  # the sim reward is a coin flip: nothing to plot
        written.append(plot_rewards(directory / "reward.png", {f"eta = {summary['eta']}": steps}))
    return written


def plot_instance_load(path: Path, samples: Sequence[Any]) -> Path | None:
    """Figure 17: per-instance running / waiting trajectories over time, with sync marks."""
    ids = sorted({i for s in samples for i in s.instances})
    if not ids:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_staleness_per_buffer(path: Path, per_buffer: dict, eta: int) -> Path | None:
    """Figure 18: the staleness distribution of each buffer's trajectories."""
    if not per_buffer:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax.set_title(f"Staleness V_buf - V_traj per buffer (bound eta = {eta})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(path: Path, steps: Sequence[dict]) -> Path | None:
    """Trained tokens per wall second of each training step."""
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rewards(path: Path, runs: Mapping[str, Sequence[dict]]) -> Path:
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


PART_COLOURS = {"decode": "tab:blue", "prefill": "tab:orange", "reprefill": "tab:red", "overhead": "tab:gray",
                "pull": "tab:green", "idle": "lightgray"}


def plot_time_breakdown(path: Path, breakdown: dict) -> Path | None:
    """Table 3 as bars: the engine-measured rollout time per instance (parts that add up to it)
    and, apart, the coordinator's command latencies. Only what was measured is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engine = breakdown.get("engine") or {}
    per_instance = engine.get("per_instance") or {}
    commands = breakdown.get("commands") or {}
    command_seconds = {k: v for k, v in (commands.get("seconds") or {}).items() if v > 0}
    if not per_instance and not command_seconds:
        return None
    rows = 2 if per_instance and command_seconds else 1
    fig, axes = plt.subplots(rows, 1, figsize=(9, 1.2 + 0.5 * (len(per_instance) + 1) + (1.6 if rows == 2 else 0)),
                             squeeze=False)
    ax_index = 0
    if per_instance:
        ax = axes[ax_index, 0]
        ax_index += 1
        names = [*per_instance, "all"]
        seconds = [per_instance[n]["seconds"] for n in per_instance] + [engine["seconds"]]
        parts = [p for p in PART_COLOURS if any(s.get(p, 0) for s in seconds)]
        parts += sorted({p for s in seconds for p in s} - set(parts))
        for row, secs in enumerate(seconds):
            left = 0.0
            for part in parts:
                value = secs.get(part, 0.0)
                ax.barh(row, value, left=left, color=PART_COLOURS.get(part), label=part if row == 0 else None)
                left += value
            ax.annotate(f"{left:.1f} s", (left, row), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, ax.get_xlim()[1] * 1.12)  # room for the totals
        ax.set_xlabel("seconds of rollout time")
        ax.set_title(f"Engine time ({engine.get('source', '')}): parts add up to the rollout time", fontsize=9)
        ax.legend(fontsize=7, ncol=len(parts), loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.05 * len(names)),
                  frameon=False)
    if command_seconds:
        ax = axes[ax_index, 0]
        kinds = list(command_seconds)
        ax.barh(range(len(kinds)), [command_seconds[k] for k in kinds], color="tab:purple")
        ax.set_yticks(range(len(kinds)), kinds, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds, summed over commands")
        ax.set_title(f"Commands: {commands.get('source', '')}\nthey overlap engine time, so they are not part of it",
                     fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_time_per_version(path: Path, per_version: dict[str, dict[str, float]], source: str) -> Path:
    """The engine's time per model version, summed over instances, as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    versions = list(per_version)
    parts = [p for p in PART_COLOURS if any(per_version[v].get(p, 0) for v in versions)]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(versions) + 3), 4))
    bottom = [0.0] * len(versions)
    for part in parts:
        values = [per_version[v].get(part, 0.0) for v in versions]
        ax.bar(versions, values, bottom=bottom, color=PART_COLOURS[part], label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("model version on the instances (its time starts with the Pull that loaded it)")
    ax.set_ylabel("instance-seconds")
    ax.set_title(f"Engine time per model version ({source})", fontsize=10)
    ax.legend(fontsize=7, ncol=len(parts))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_staleness_convergence(path: Path, runs: Sequence[dict]) -> Path:
    """The paper's Figure 14: mean reward of the batch against the training step (left) and
    against wall-clock time (right), one line per run (``staleflow.staleness_experiment.run_numbers``
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
