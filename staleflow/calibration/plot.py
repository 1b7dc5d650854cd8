"""Measured vs estimated throughput of a calibration, as PNG (``staleflow calibrate --plot``)."""

from __future__ import annotations

from pathlib import Path

from staleflow.calibration.fit import PAPER_MAPE, DecodeReport
from staleflow.calibration.run import crossover_text
from staleflow.calibration.schema import CalibrationEntry


def plot_calibration(entry: CalibrationEntry, report: DecodeReport, path: Path) -> None:
    """Measured vs estimated throughput (cf. the paper's Figure 24) and a parity plot, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    measured = np.array([s.n / s.latency for s in report.samples])
    predicted = np.array([s.n / p for s, p in zip(report.samples, report.predicted, strict=True)])
    cv = np.array([np.nan if p is None else s.n / p
                   for s, p in zip(report.samples, report.cv_predicted or [None] * len(report.samples), strict=True)])
    held = ~np.isnan(cv)
    q = entry.quality
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.7, 1]})
    x = np.arange(len(measured))
    left.plot(x, measured, ".", color="tab:blue", label="actual", markersize=4)
    left.plot(x, predicted, "-", color="tab:orange", label="estimated (cost model)", linewidth=1)
    left.set_yscale("log")
    left.set_xlabel("profiling sample (grid points in order of n)")
    left.set_ylabel("throughput (tokens/s)")
    left.set_title(f"{entry.model} / {entry.parallelism}: in-sample error {q.mape:.2%}")
    left.legend()
    top = max(measured.max(), predicted.max()) * 1.1
    bottom = min(measured.min(), predicted.min()) / 1.1
    line = np.geomspace(bottom, top, 50)
    right.fill_between(line, line * (1 - PAPER_MAPE), line * (1 + PAPER_MAPE), color="0.9", label=f"±{PAPER_MAPE:.2%}")
    right.plot(line, line, "k-", linewidth=0.8)
    right.scatter(measured, predicted, s=8, label=f"shipped fit ({q.mape:.2%} error)")
    if held.any():
        right.scatter(measured[held], cv[held], s=10, marker="x", color="tab:red", linewidths=0.8,
                      label=f"cross-validated ({q.holdout_mape:.2%} error)")
    right.set_xscale("log")
    right.set_yscale("log")
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # crowded on a narrow decade
    right.set_xlabel("actual throughput (tokens/s)")
    right.set_ylabel("estimated throughput (tokens/s)")
    right.set_title(f"r² {q.r2:.3f}, n*{crossover_text(entry)}")
    right.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
