"""``staleflow bench ledger``'s measuring (``run_ledger_bench``) on a tiny ledger: every part runs
and reports its rate, latency and CPU time per operation."""

from __future__ import annotations

from staleflow.servers.manager.bench import LEDGER_BENCH_PARTS, run_ledger_bench


def test_every_part_of_the_ledger_bench_reports_rates_latencies_and_cpu_per_operation() -> None:
    parts: list[None] = []
    results = run_ledger_bench(eta=1, batch_size=4, steps=4, http_requests=10, workers=2,
                               advance=lambda: parts.append(None))
    assert len(parts) == LEDGER_BENCH_PARTS
    # a step reserves and occupies what is admissible at the newest version and consumes a buffer:
    # the first step fills both buffers of the window (eta + 1 of 4), each later one the new buffer
    assert results["pure"]["transitions"] == (2 * 8 + 1) + 3 * (2 * 4 + 1)
    for part in ("pure", "durable_sequential", "durable_concurrent", "durable_concurrent_normal"):
        assert results[part]["per_second"] > 0 and results[part]["cpu_us_per_transition"] > 0
    assert results["durable_concurrent"]["workers"] == 2
    http = results["http"]
    assert http["reserve"]["n"] == http["occupy"]["n"] == 10
    assert 0 < http["reserve"]["p50_ms"] <= http["reserve"]["p99_ms"] and http["cpu_us_per_request"] > 0
