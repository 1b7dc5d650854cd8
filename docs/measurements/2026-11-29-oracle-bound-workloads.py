"""Writes the two response-length workloads the oracle-bound measurements replay (seeded, so the
files are reproducible): ``bimodal-20k.json`` (each group a mix of short answers and long
reasoning, the share of long ones drawn per group) and ``pareto-40k.json`` (heavy-tailed lengths,
a Pareto tail with alpha 1.5 and a per-group scale, cut at 40,960). 4,096 groups of 16 each.

    .venv/bin/python docs/measurements/2026-11-29-oracle-bound-workloads.py /tmp/workloads
"""

import json
import sys
from pathlib import Path

import numpy as np

GROUPS, MEMBERS = 4096, 16


def bimodal(rng: np.random.Generator) -> list[list[int]]:
    out = []
    for _ in range(GROUPS):
        long_share = rng.beta(0.6, 1.4)
        short = rng.lognormal(np.log(1200), 0.5, MEMBERS)
        long = rng.uniform(12_000, 20_480, MEMBERS)
        pick = rng.random(MEMBERS) < long_share
        out.append([int(min(20_480, max(16, x))) for x in np.where(pick, long, short)])
    return out


def pareto(rng: np.random.Generator) -> list[list[int]]:
    out = []
    for _ in range(GROUPS):
        scale = rng.lognormal(np.log(2500), 0.4)
        lengths = scale * (1 + rng.pareto(1.5, MEMBERS))
        out.append([int(min(40_960, max(16, x))) for x in lengths])
    return out


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    folder.mkdir(parents=True, exist_ok=True)
    for name, make in (("bimodal-20k", bimodal), ("pareto-40k", pareto)):
        groups = make(np.random.default_rng(20261129))
        (folder / f"{name}.json").write_text(json.dumps(groups))
        flat = np.array(groups).ravel()
        print(name, "mean", round(flat.mean()), "median", int(np.median(flat)), "p99", int(np.percentile(flat, 99)),
              "max", flat.max())
