"""Figures in the style of the paper's §6 (13, 15, 16, 17, 18) from an ``ExperimentResult``.

Each function returns a ``matplotlib.figure.Figure`` (object API, Agg canvas, no pyplot state) or
None when the result holds nothing to draw; callers save them.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from staleflow.simulation.experiment import ALL_VANILLA, REFERENCE, ExperimentResult
from staleflow.simulation.result import RunResult
from staleflow.simulation.systems import HEADLINE

_SHORT = {"synchronous": "vs sync", "one-step": "vs 1-step", "in-flight-limited": "vs in-flight",
          "completion-order": "vs in-flight-fifo", "laminar": "vs laminar"}
_COLORS = {"verl": "#9e9e9e", "one-step": "#f2a541", "in-flight": "#4c78a8", "in-flight-fifo": "#72b7b2",
           "laminar": "#8c564b", "sf-rsm": "#d62728", "oracle": "#2ca02c"}
REPACK_SYSTEMS = {"sf-rsm": "#d62728", "sf-rsm+repack": "#ff9896", "sf-repack": "#e377c2", "laminar": "#8c564b"}


def _headline(result: ExperimentResult) -> list[str]:
    present = {name for p in result.points for name in p.runs}
    return [name for name in HEADLINE if name in present]


def _grouped_bars(result: ExperimentResult, series: list[tuple[str, str, str]], title: str):
    """Bars of throughput per point, one bar per (system, legend label, colour) in ``series``."""
    points = result.points
    fig = Figure(figsize=(max(6.0, 0.8 * len(points) * len(series)), 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    for k, (name, label, color) in enumerate(series):
        offset = (k - (len(series) - 1) / 2) * width
        xs = [i + offset for i, p in enumerate(points) if name in p.runs]
        ax.bar(xs, [p.runs[name].throughput / 1e3 for p in points if name in p.runs], width, label=label, color=color)
    ax.set_xticks(range(len(points)), [p.point.label for p in points], fontsize=8)
    ax.set_ylabel("throughput (K tokens/s)")
    ax.set_title(title, fontsize=10)
    return fig, ax


def throughput_bars(result: ExperimentResult) -> Figure | None:
    """Figure 13: throughput per staleness bound, StaleFlow's gain over each baseline annotated."""
    names = _headline(result)
    if not names:
        return None
    labels = {name: r.label for p in result.points for name, r in p.runs.items()}
    fig, ax = _grouped_bars(result, [(n, labels[n], _COLORS[n]) for n in names],
                            f"{result.spec.scenario.name}: end-to-end throughput (gains of StaleFlow over the baselines)")
    for i, p in enumerate(result.points):
        gains = p.ratios(REFERENCE)
        if REFERENCE in p.runs and gains:
            text = "\n".join(f"{_SHORT.get(family, family)} {g:.2f}x" for family, g in gains.items())
            top = max(r.throughput for r in p.runs.values()) / 1e3
            ax.annotate(text, (i, top), ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.legend(fontsize=7, loc="lower right")
    ax.margins(y=0.3)
    return fig


def scaling_lines(result: ExperimentResult) -> Figure | None:
    """Figure 15: absolute and relative (to the synchronous system) throughput along the sweep."""
    spec = result.spec
    names = _headline(result)
    if not spec.sweep_key or not names:
        return None
    fig = Figure(figsize=(10, 4), layout="constrained")
    absolute, relative = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for eta in spec.etas:
        rows = [p for p in result.points if p.point.eta == eta]
        xs = [v for p in rows if (v := p.point.sweep_value) is not None]  # a sweep's points all have one
        for name in names:
            ys = [p.runs[name].throughput / 1e3 if name in p.runs else float("nan") for p in rows]
            color, linestyle = _COLORS.get(name), ["-", "--", ":", "-."][spec.etas.index(eta) % 4]
            label = f"{name} (eta={eta})"
            absolute.plot(xs, ys, label=label, color=color, marker="o", linestyle=linestyle)
            base = [p.runs["verl"].throughput if "verl" in p.runs else float("nan") for p in rows]
            relative.plot(xs, [y * 1e3 / b for y, b in zip(ys, base, strict=True)], label=label, color=color, marker="o",
                          linestyle=linestyle)
    for ax, ylabel in ((absolute, "throughput (K tokens/s)"), (relative, "relative to synchronous")):
        ax.set_xlabel(spec.sweep_key)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    relative.legend(fontsize=6)
    fig.suptitle(f"{spec.scenario.name}: scaling with {spec.sweep_key}")
    return fig


def ablation_bars(result: ExperimentResult) -> Figure | None:
    """Figure 16: the eight R/S/M combinations (throughput-oriented or vanilla) per point."""
    variants = [s for s in result.spec.systems if s.ablation]
    if len(variants) < 2:
        return None
    series = [(s.name, (s.ablation or "").replace("x", "×"), f"C{k}") for k, s in enumerate(variants)]
    fig, ax = _grouped_bars(result, series, "Ablation: R/S/M = throughput-oriented routing/sync/migration, "
                                            "× = vanilla (dashed: in-flight-limited)")
    for i, p in enumerate(result.points):
        if "in-flight" in p.runs:
            y = p.runs["in-flight"].throughput / 1e3
            ax.hlines(y, i - 0.45, i + 0.45, colors="black", linestyles="dashed", linewidth=0.8)
    ax.legend(fontsize=7, ncols=4, loc="lower right")
    ax.margins(y=0.15)
    return fig


def _detail_runs(result: ExperimentResult) -> list[RunResult]:
    eta = result.spec.detail_eta
    for p in result.points:
        if p.point.eta == eta:
            return [p.runs[n] for n in (REFERENCE, ALL_VANILLA) if n in p.runs and p.runs[n].timeline is not None]
    return []


def instance_load(result: ExperimentResult, instances: int = 4) -> Figure | None:
    """Figure 17: trajectories on each of the first instances over time; green lines: Pulls."""
    runs = _detail_runs(result)
    if not runs:
        return None
    shown = min(instances, runs[0].instances)
    fig = Figure(figsize=(5.5 * len(runs), 1.7 * shown + 0.8), layout="constrained")
    for col, run in enumerate(runs):
        tl = run.timeline
        assert tl is not None
        for row in range(shown):
            ax = fig.add_subplot(shown, len(runs), row * len(runs) + col + 1)
            running = [s[row] for s in tl.running]
            waiting = [s[row] for s in tl.waiting]
            ax.fill_between(tl.times, 0, running, step="post", color="#4c78a8", alpha=0.7, label="running")
            ax.fill_between(tl.times, running, [r + w for r, w in zip(running, waiting, strict=True)], step="post",
                            color="#f58518", alpha=0.7, label="waiting")
            for t, i, version in tl.syncs:
                if i == row:
                    ax.axvline(t, color="green", linewidth=0.8)
                    ax.annotate(f"V{version}", (t, 0), fontsize=6, color="green", rotation=90, va="bottom")
            ax.set_ylabel(f"inst {row}", fontsize=8)
            ax.tick_params(labelsize=7)
            if row == 0:
                ax.set_title(run.label, fontsize=9)
                if col == 0:
                    ax.legend(fontsize=6, loc="upper right")
        ax.set_xlabel("virtual time (s)")
    fig.suptitle(f"Per-instance rollout load, eta={runs[0].eta}")
    return fig


def staleness_histograms(result: ExperimentResult) -> Figure | None:
    """Figure 18: V_buf - V_traj of the trajectories in every staleness buffer (StaleFlow)."""
    run = next((r for r in _detail_runs(result) if r.system == REFERENCE), None)
    if run is None:
        run = next((p.runs[REFERENCE] for p in result.points if REFERENCE in p.runs), None)
    if run is None:
        return None
    buffers = sorted(run.staleness)
    fig = Figure(figsize=(max(5.0, 0.6 * len(buffers)), 3.6), layout="constrained")
    ax = fig.add_subplot()
    bottom = [0] * len(buffers)
    for s in range(run.eta + 1):
        counts = [run.staleness[b].get(s, 0) for b in buffers]
        ax.bar(buffers, counts, bottom=bottom, label=f"staleness {s}", color=f"C{s}")
        bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set_xlabel("staleness buffer (V_buf)")
    ax.set_ylabel("trajectories")
    ax.set_title(f"{run.system}: V_buf - V_traj per buffer (eta={run.eta}, {run.violations} violations)", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def staleness_tradeoff(result: ExperimentResult) -> Figure | None:
    """Throughput against the realised p99 staleness, one curve per headline or bound-breaking
    system (StaleFlow's runs at the peers' realised staleness included), one panel per sweep
    value: the trade-off a user picks a point on."""
    values = list(dict.fromkeys(p.point.sweep_value for p in result.points))
    runs: dict[tuple[float | None, str], list[RunResult]] = {}
    for p in result.points:
        for name, run in p.runs.items():
            runs.setdefault((p.point.sweep_value, name), []).append(run)
    for m in result.matched:
        runs.setdefault((m.sweep_value, REFERENCE), []).append(m.staleflow)
    if not runs:
        return None
    fig = Figure(figsize=(5.0 * len(values), 4.0), layout="constrained")
    for k, value in enumerate(values):
        ax = fig.add_subplot(1, len(values), k + 1)
        for system in result.spec.systems:
            mine = runs.get((value, system.name))
            if not mine or (system.name not in HEADLINE and system.keeps_bound):
                continue
            curve = sorted({(r.realised_staleness()["p99"], r.throughput / 1e3) for r in mine})
            ax.plot([x for x, _ in curve], [y for _, y in curve], marker="o", label=system.name,
                    color=_COLORS.get(system.name), linestyle="-" if system.keeps_bound else "--")
        ax.set_xlabel("realised p99 staleness (V_buf - V_traj)")
        ax.set_ylabel("throughput (K tokens/s)")
        ax.set_title(result.spec.scenario.name if value is None else f"{result.spec.sweep_key} = {value:g}",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("Throughput against realised staleness (dashed: bound not kept)", fontsize=10)
    return fig


def repack_bars(result: ExperimentResult) -> Figure | None:
    """Repack side by side: throughput (left) and the mean KV utilisation of busy instances
    (right) of StaleFlow with and without Laminar's repack, and Laminar, per point."""
    present = {name for p in result.points for name in p.runs}
    series = [(name, color) for name, color in REPACK_SYSTEMS.items() if name in present]
    if not any(name in present for name in ("sf-rsm+repack", "sf-repack")):
        return None
    points = result.points
    fig = Figure(figsize=(max(8.0, 1.2 * len(points) * len(series)), 4.0), layout="constrained")
    width = 0.8 / len(series)
    for panel, (value, label) in enumerate(((lambda r: r.throughput / 1e3, "throughput (K tokens/s)"),
                                             (lambda r: 100 * r.busy_kv_utilisation, "KV utilisation of busy "
                                                                                     "instances (%)"))):
        ax = fig.add_subplot(1, 2, panel + 1)
        for k, (name, color) in enumerate(series):
            offset = (k - (len(series) - 1) / 2) * width
            xs = [i + offset for i, p in enumerate(points) if name in p.runs]
            ax.bar(xs, [value(p.runs[name]) for p in points if name in p.runs], width, label=name, color=color)
        ax.set_xticks(range(len(points)), [p.point.label for p in points], fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{result.spec.scenario.name}: Laminar's repack beside StaleFlow's migration", fontsize=10)
    return fig


FIGURES = {
    "fig13_throughput": throughput_bars,
    "fig15_scaling": scaling_lines,
    "fig16_ablation": ablation_bars,
    "fig17_instance_load": instance_load,
    "fig18_staleness": staleness_histograms,
    "staleness_tradeoff": staleness_tradeoff,
    "repack": repack_bars,
}
