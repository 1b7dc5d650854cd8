"""Tables of an ``ExperimentResult`` as plain data (title, header, rows of strings) and Markdown."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from staleflow.simulation.experiment import (
    ALL_VANILLA,
    CHECK,
    ORACLE,
    REFERENCE,
    ExperimentResult,
    PointResult,
)
from staleflow.simulation.result import RunResult
from staleflow.simulation.systems import BASELINES


@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.header) + " |",
                 "|" + "|".join("---" for _ in self.header) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in self.rows]
        return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _n(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def throughput_table(result: ExperimentResult) -> Table:
    points = result.points
    rows = []
    for system in result.spec.systems:
        cells = []
        for p in points:
            run = p.runs.get(system.name)
            cells.append("-" if run is None else _n(run.throughput))
        rows.append([system.name, system.label, *cells])
    if any(p.oracle_eta for p in points):
        rows.append(["oracle-eta", "Upper bound under the staleness bound (a relaxation, computed)",
                     *["-" if not p.oracle_eta else _n(p.oracle_eta) for p in points]])
    if any(p.oracle_eta_schedule for p in points):
        rows.append(["oracle-eta schedule", "Best clairvoyant schedule found under the bound (computed)",
                     *["-" if not p.oracle_eta_schedule else _n(p.oracle_eta_schedule) for p in points]])
    return Table("Throughput (response tokens/s over all trained steps)", ["system", "models",
                                                                            *[p.point.label for p in points]], rows)


def gains_table(result: ExperimentResult) -> Table:
    points = result.points
    summary = result.summary()
    rows = []
    for key, steady, suffix in (("vs", False, ""), ("steady_vs", True, " (second half of the steps)")):
        for family in BASELINES:
            per_point = [p.ratios(REFERENCE, steady).get(family.value) for p in points]
            if all(v is None for v in per_point):
                continue
            s = summary[key].get(family.value, {})
            rows.append([f"StaleFlow / {family.value}{suffix}", *[_x(v) for v in per_point], _x(s.get("mean")),
                         _x(s.get("max")), f"{_x(s.get('paper_mean'))} / {_x(s.get('paper_max'))}"])
    vanilla = [p.same_split_ratio(ALL_VANILLA, CHECK) for p in points]
    if any(v is not None for v in vanilla):
        present = [v for v in vanilla if v is not None]
        rows.append(["all-vanilla StaleFlow / in-flight on the same PS, engine and split", *[_x(v) for v in vanilla],
                     _x(sum(present) / len(present)), _x(max(present)), "~1.00x"])
    if any(ORACLE in p.runs for p in points):
        rows += _share_rows(result, "oracle (share of the upper bound)", PointResult.oracle_share, skip=ORACLE)
    if any(p.oracle_eta for p in points):
        rows += _share_rows(result, "oracle-eta (share of the upper bound under the staleness bound)",
                            PointResult.oracle_eta_share)
    if any(ORACLE in p.runs for p in points):
        recovered = [p.gap_recovered(REFERENCE) for p in points]
        present = [v for v in recovered if v is not None]
        if present:
            rows.append(["StaleFlow's share of in-flight's gap to the oracle", *[_pct(v) for v in recovered],
                         _pct(sum(present) / len(present)), _pct(max(present)), ""])
    return Table("Gains (throughput ratios)", ["ratio", *[p.point.label for p in points], "mean", "max",
                                                "paper mean / max"], rows)


def _share_rows(result: ExperimentResult, label: str, share: Callable[[PointResult, str], float | None],
                skip: str | None = None) -> list[list[str]]:
    rows = []
    for system in result.spec.systems:
        if system.name == skip:
            continue
        shares = [share(p, system.name) for p in result.points]
        present = [v for v in shares if v is not None]
        if present:
            rows.append([f"{system.name} / {label}", *[_pct(v) for v in shares], _pct(sum(present) / len(present)),
                         _pct(max(present)), ""])
    return rows


def detail_point(result: ExperimentResult) -> PointResult:
    eta = result.spec.detail_eta
    return next((p for p in result.points if p.point.eta == eta), result.points[-1])


def detail_table(result: ExperimentResult, point: PointResult | None = None) -> Table:
    """Per-system metrics at one point: split, lengths, staleness, decisions, command counts."""
    p = point or detail_point(result)
    rows = []
    for name, run in p.runs.items():
        c = run.counters
        rows.append([
            name, f"{run.instances}/{run.train_gpus}", _n(run.step_time_s), _n(run.steady_throughput),
            _n(run.mean_response),
            f"{run.max_response:,}", " ".join(f"{s}:{n}" for s, n in run.staleness_total().items()),
            str(run.violations), _exceeded(run), f"{run.decisions.mean_ms:.1f}/{run.decisions.p99_ms:.0f}",
            f"{c.get('interrupted', 0):,}/{c.get('migrated', 0):,}/{c.get('repacked', 0):,}/{c.get('pulls', 0):,}",
            f"{run.wall_s:.1f}",
        ])
    header = ["system", "inst/train GPUs", "step s", "2nd-half tok/s", "mean len", "max len", "staleness V_buf-V_traj: n",
              "violations", "over eta: n (max)", "plan ms mean/p99", "interrupted/migrated/repacked/pulls",
              "wall s"]
    return Table(f"Details at {p.point.label}", header, rows)


def _exceeded(run: RunResult) -> str:
    trained = sum(r.trajectories for r in run.step_records)
    if not run.exceedances:
        return "0"
    return f"{run.exceedances:,} ({100 * run.exceedances / trained:.0f}%, +{run.max_exceedance})"


def breakdown_table(result: ExperimentResult, point: PointResult | None = None) -> Table:
    """Table 3: where each rollout instance's time went, per training step."""
    p = point or detail_point(result)
    keys = ("decode_s", "prefill_s", "pull_s", "route_s", "interrupt_s", "train_s", "idle_s")
    rows = []
    for name, run in p.runs.items():
        b, f = run.breakdown, run.breakdown.fractions()
        rows.append([name, *(f"{getattr(b, k):.1f} ({100 * f[k]:.1f}%)" for k in keys),
                     _pct(run.busy_kv_utilisation)])
    header = ["system", "decode s", "prefill s", "pull s", "route s", "interrupt s", "train s", "idle s",
              "KV use while busy"]
    return Table(f"Per-step time of a rollout instance at {p.point.label} (cf. Table 3)", header, rows)


def skew_table(result: ExperimentResult, point: PointResult | None = None) -> Table:
    """What each system's staleness policy did to the response lengths (``staleflow.length_skew``)."""
    p = point or detail_point(result)
    rows = []
    for name, run in p.runs.items():
        rows.append([name, *length_skew_cells(run.length_skew)])
    return Table(f"Length skew at {p.point.label}: trained against generated (fate known) response lengths",
                 LENGTH_SKEW_HEADER, rows)


LENGTH_SKEW_HEADER = ["system", "mean trained / generated", "KS", "W1 tokens", "cut: aborted/filtered/dropped",
                      "staleness by length bucket", "admission waited: n (mean s)"]


def length_skew_cells(skew: dict | None) -> list[str]:
    """One run's skew summary as table cells (after the system's name)."""
    if not skew:
        return ["-"] * (len(LENGTH_SKEW_HEADER) - 1)
    settled = sum(skew["trained"].values()) + sum(sum(skew[f].values()) for f in ("aborted", "filtered", "dropped"))
    cut = [sum(skew[f].values()) for f in ("aborted", "filtered", "dropped")]
    share = f" ({100 * sum(cut) / settled:.0f}%)" if settled and sum(cut) else ""
    admission = skew["admission"]

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    return [number(skew["trained_over_generated_mean"], 3), number(skew["ks_distance"], 3),
            number(skew["wasserstein_tokens"], 1), "/".join(str(n) for n in cut) + share,
            " ".join(f"{bucket}:{mean:.2f}" for bucket, mean in skew["staleness_mean"].items()),
            f"{admission['waited']} ({admission['mean_wait_s']:.2f})"]


def matched_table(result: ExperimentResult) -> Table | None:
    """StaleFlow run with eta = each bound-breaking peer's realised p99 and max staleness, against
    the peer at its nominal eta."""
    if not result.matched:
        return None
    rows = []
    for m in result.matched:
        point = f"eta={m.peer_eta}" if m.sweep_value is None else f"{m.sweep_value:g}, eta={m.peer_eta}"
        rows.append([m.peer, point, f"{m.realised_p99} / {m.realised_max} ({100 * m.over_eta_share:.0f}%)",
                     str(m.staleflow_eta), _n(m.peer_throughput), _n(m.staleflow.throughput), _x(m.ratio),
                     str(m.staleflow.violations)])
    header = ["peer", "peer's point", "peer's realised p99 / max (share over eta)", "StaleFlow eta", "peer tok/s",
              "StaleFlow tok/s", "StaleFlow / peer", "StaleFlow violations"]
    return Table("Matched staleness: StaleFlow bounded at each bound-breaking peer's realised staleness", header, rows)


def tables(result: ExperimentResult) -> list[Table]:
    out = [throughput_table(result), gains_table(result), matched_table(result), detail_table(result),
           breakdown_table(result), skew_table(result)]
    return [t for t in out if t is not None]


def markdown(result: ExperimentResult, command: str | None = None) -> str:
    s = result.spec.scenario
    head = [f"### `bench systems`: {s.name} ({s.workload.batch_size}x{s.workload.group_size}, "
            f"<= {s.workload.max_response_tokens:,} response tokens, {s.total_gpus} GPUs, {result.spec.steps} steps)", ""]
    if command:
        head += ["```", command, "```", ""]
    body = "\n\n".join(t.markdown() for t in tables(result))
    return "\n".join(head) + body + f"\n\nwall time: {result.wall_s:.0f} s\n"
