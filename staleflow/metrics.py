"""Prometheus metrics of every StaleFlow service: one catalogue of names, one way to serve them.

Every service mounts ``GET /metrics`` with ``mount_metrics(app, component, *collectors)``. It
gets the metrics every service has (HTTP requests and their latency, labelled by ``component``)
plus its own, produced at scrape time by *collectors*: functions that read the service's state
and return metric families built from the ``Metric`` entries below. The names are the same in
every process (prefix ``staleflow_``), so one dashboard (``deploy/grafana/``) reads them all.

Each app gets its own registry: several services can share a process (``staleflow up`` embeds
them as threads) without their series mixing. Counter names are given without ``_total``; the
exposition adds it (``staleflow_http_requests_total``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.core import Metric as MetricFamily

from staleflow.length_skew import StepSkew, TrajectoryFate, bucket_label

Kind = Literal["gauge", "counter", "summary", "histogram"]
Samples = Iterable[tuple[Sequence[str], float]]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Metric:
    """One metric's name, type, meaning and label names."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.startswith("staleflow_"):
            raise ValueError(f"metric {self.name!r}: every StaleFlow metric starts with staleflow_")
        if self.kind == "counter" and self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: give counters without _total (the exposition adds it)")

    def family(self, samples: Samples) -> MetricFamily:
        """The metric with these ``(label values, value)`` samples (gauges and counters)."""
        if self.kind in ("summary", "histogram"):
            raise TypeError(f"{self.name} is a {self.kind}: not a plain sample family")
        cls = GaugeMetricFamily if self.kind == "gauge" else CounterMetricFamily
        family = cls(self.name, self.help, labels=list(self.labels))
        for labels, value in samples:
            family.add_metric(list(labels), float(value))
        return family

    def value(self, value: float, *labels: str) -> MetricFamily:
        """The metric with a single sample."""
        return self.family([(labels, value)])

    def summary(self, samples: Iterable[tuple[Sequence[str], int, float]]) -> MetricFamily:
        """A summary from ``(label values, count, sum)`` samples (``_count`` and ``_sum`` series)."""
        if self.kind != "summary":
            raise TypeError(f"{self.name} is a {self.kind}, not a summary")
        family = SummaryMetricFamily(self.name, self.help, labels=list(self.labels))
        for labels, count, total in samples:
            family.add_metric(list(labels), count_value=count, sum_value=total)
        return family

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names this metric appears under in the exposition."""
        if self.kind == "counter":
            return (f"{self.name}_total",)
        if self.kind == "summary":
            return (f"{self.name}_count", f"{self.name}_sum")
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_count", f"{self.name}_sum")
        return (self.name,)


# ---------------------------------------------------------------------------- every service

HTTP_REQUESTS = Metric("staleflow_http_requests", "counter", "HTTP requests answered",
                       ("component", "method", "route", "status"))
HTTP_SECONDS = Metric("staleflow_http_request_seconds", "histogram", "HTTP request latency",
                      ("component", "method", "route"))
COMPONENT_INFO = Metric("staleflow_component_info", "gauge", "1 for each running StaleFlow service", ("component",))
COMPONENT_STARTED = Metric("staleflow_component_start_time_seconds", "gauge", "when the service started (Unix time)",
                           ("component",))

# ---------------------------------------------------------------------------- staleness manager

LEDGER_TRAIN_VERSION = Metric("staleflow_ledger_train_version", "gauge", "buffers consumed so far (trainer version)")
LEDGER_ENTRIES = Metric("staleflow_ledger_entries", "gauge", "live ledger entries by status", ("status",))
LEDGER_BUFFERS = Metric("staleflow_ledger_buffers", "gauge", "live buffers by state", ("state",))
LEDGER_ADMITTED = Metric("staleflow_ledger_admitted", "counter", "groups admitted (reserved)")
LEDGER_OCCUPIED = Metric("staleflow_ledger_occupied", "counter", "groups occupied")
LEDGER_CONSUMED_GROUPS = Metric("staleflow_ledger_consumed_groups", "counter", "groups consumed by the trainer")
LEDGER_CONSUMED_BUFFERS = Metric("staleflow_ledger_consumed_buffers", "counter", "buffers consumed by the trainer")
LEDGER_ABORTED_GROUPS = Metric("staleflow_ledger_aborted_groups", "counter", "groups aborted", ("reason",))

# ---------------------------------------------------------------------------- rollout instances

INSTANCE_TRAJECTORIES = Metric("staleflow_instance_trajectories", "gauge",
                               "trajectories on the instance: running, waiting, complete (since the last Pull)",
                               ("instance_id", "state"))
INSTANCE_VERSION = Metric("staleflow_instance_version", "gauge", "model version the instance serves", ("instance_id",))
INSTANCE_KV_CACHE = Metric("staleflow_instance_kv_cache_tokens", "gauge", "KV cache held by running trajectories",
                           ("instance_id",))
INSTANCE_LOADING = Metric("staleflow_instance_loading_weights", "gauge", "1 while a Pull loads weights",
                          ("instance_id",))
INSTANCE_COMMANDS = Metric("staleflow_instance_commands", "counter", "commands applied, by kind",
                           ("instance_id", "kind"))
INSTANCE_COMPLETED = Metric("staleflow_instance_completed_trajectories", "counter",
                            "trajectories finished (completions fed to the trajectory server)", ("instance_id",))
INSTANCE_GENERATED_TOKENS = Metric("staleflow_instance_generated_tokens", "counter", "response tokens generated",
                                   ("instance_id",))
INSTANCE_CHECKPOINTED_TOKENS = Metric("staleflow_instance_checkpointed_tokens", "counter",
                                      "response tokens sent to the trajectory server in progress checkpoints",
                                      ("instance_id",))
INSTANCE_ENGINE_SECONDS = Metric("staleflow_instance_engine_seconds", "counter",
                                 "the engine's time by part (decode, prefill, reprefill, overhead, pull, idle); "
                                 "parts sum to the rollout time", ("instance_id", "part", "source"))
INSTANCE_ROLLOUT_SECONDS = Metric("staleflow_instance_rollout_seconds", "counter",
                                  "rollout time the engine accounted for", ("instance_id", "source"))

# ---------------------------------------------------------------------------- coordinator

COORDINATOR_CYCLES = Metric("staleflow_coordinator_cycles", "counter", "snapshot-command cycles run")
COORDINATOR_DECISION_SECONDS = Metric("staleflow_coordinator_decision_seconds", "summary",
                                      "time the strategies took to plan a cycle")
COORDINATOR_SNAPSHOTS = Metric("staleflow_coordinator_snapshots", "counter",
                               "instance snapshots, accepted (matching the speculative state) or discarded",
                               ("result",))
COORDINATOR_COMMAND_SECONDS = Metric("staleflow_coordinator_command_seconds", "summary",
                                     "command latency, issued to answered", ("kind",))
COORDINATOR_TRAJECTORIES = Metric("staleflow_coordinator_trajectories", "counter",
                                  "trajectories moved by commands: routed, interrupted, aborted", ("action",))
COORDINATOR_PULLS = Metric("staleflow_coordinator_pulls", "counter", "Pull commands completed")
COORDINATOR_INSTANCES = Metric("staleflow_coordinator_instances", "gauge", "registered instances by status",
                               ("status",))
COORDINATOR_FAILURES = Metric("staleflow_coordinator_instance_failures", "counter", "instances declared failed")
COORDINATOR_PS_VERSION = Metric("staleflow_coordinator_params_version", "gauge",
                                "newest version on the parameter server, as the coordinator saw it")
COORDINATOR_ESTIMATED_THROUGHPUT = Metric("staleflow_coordinator_estimated_throughput", "gauge",
                                          "cost-model throughput estimate per instance (tokens/s)", ("instance_id",))

# ---------------------------------------------------------------------------- trajectory server

TRAJECTORIES = Metric("staleflow_trajectories", "gauge", "trajectories in the trajectory server by state", ("state",))
TRAJECTORIES_COMPLETED = Metric("staleflow_trajectories_completed", "counter",
                                "completed trajectories accepted from instances")
TRAJECTORY_REWARD = Metric("staleflow_trajectory_reward", "summary", "rewards of completed trajectories")
TRAJECTORY_RESPONSE_TOKENS = Metric("staleflow_trajectory_response_tokens", "summary",
                                    "response lengths of completed trajectories")
TRAJECTORY_CHECKPOINTED_TOKENS = Metric("staleflow_trajectory_checkpointed_tokens", "counter",
                                        "response tokens appended from instances' progress checkpoints")
TRAJECTORY_FAILURE_RESUMED_TOKENS = Metric("staleflow_trajectory_failure_resumed_tokens", "counter",
                                           "response tokens kept by trajectories handed back from a failed instance")
TRAJECTORIES_FAILED_OVER = Metric("staleflow_trajectories_failed_over", "counter",
                                  "running trajectories handed back from a failed instance")
TRAJECTORY_FAILURE_REGENERATED_TOKENS = Metric(
    "staleflow_trajectory_failure_regenerated_tokens", "counter",
    "response tokens trajectories handed back from a failed instance had generated beyond their last checkpoint "
    "(generated again)")
TRAJECTORY_STALENESS_VIOLATIONS = Metric(
    "staleflow_trajectory_staleness_violations", "counter",
    "trained trajectories with a token more than eta versions older than their buffer (must stay 0)")
LENGTH_SKEW_TRAJECTORIES = Metric(
    "staleflow_length_skew_trajectories", "counter",
    "trajectories by what became of them (generated, trained, aborted, filtered, dropped, regenerated) and "
    "response-length bucket (powers of two)", ("fate", "bucket"))
LENGTH_SKEW_REGENERATED_TOKENS = Metric("staleflow_length_skew_regenerated_tokens", "counter",
                                        "tokens generated again after an instance failure, by length bucket",
                                        ("bucket",))
LENGTH_SKEW_IN_FLIGHT = Metric("staleflow_length_skew_in_flight", "gauge",
                               "generated trajectories whose fate is not known yet, by length bucket", ("bucket",))
LENGTH_SKEW_STALENESS = Metric("staleflow_length_skew_staleness", "summary",
                               "staleness (V_buf minus the oldest segment version) of trained trajectories, by length bucket", ("bucket",))
ADMISSION_WAIT_SECONDS = Metric("staleflow_admission_wait_seconds", "summary",
                                "how long each admitted group waited from sampled to admitted by the ledger")
ADMISSION_WAITED = Metric("staleflow_admission_waited_groups", "counter",
                          "admitted groups that waited (were not admitted as they were sampled)")

# ---------------------------------------------------------------------------- parameter server

PARAMS_LATEST_VERSION = Metric("staleflow_params_latest_version", "gauge", "newest complete version (-1: none)")
PARAMS_VERSIONS = Metric("staleflow_params_versions", "gauge", "versions stored")
PARAMS_STORED_BYTES = Metric("staleflow_params_stored_bytes", "gauge", "bytes of the versions stored")
PARAMS_PUSHES = Metric("staleflow_params_pushes", "counter", "versions pushed (committed)")
PARAMS_PULLS = Metric("staleflow_params_pulls", "counter", "pulls started, by transport", ("transport",))
PARAMS_ACTIVE_PULLS = Metric("staleflow_params_active_pulls", "gauge", "pulls in progress (leases held)")

# ---------------------------------------------------------------------------- reward server

REWARD_ITEMS = Metric("staleflow_reward_items", "counter", "items scored, by verifier", ("verifier",))
REWARD_TIMEOUTS = Metric("staleflow_reward_timeouts", "counter",
                         "items whose verifier overran its deadline (its worker was replaced), by verifier", ("verifier",))
REWARD_SECONDS = Metric("staleflow_reward_batch_seconds", "summary", "time to score one request's batch")
REWARD_VALUE = Metric("staleflow_reward_value", "summary", "rewards given, by verifier", ("verifier",))

def length_skew_families(total: StepSkew, in_flight: Mapping[int, int]) -> list[MetricFamily]:
    """The trajectory server's length-skew accounting (``staleflow.length_skew``) as metric families."""
    counts = [(("generated", bucket_label(b)), n) for b, n in sorted(total.generated.items())]
    counts += [((fate.value, bucket_label(b)), n) for fate in TrajectoryFate for b, n in sorted(total.fates[fate].items())]
    counts += [(("regenerated", bucket_label(b)), n) for b, n in sorted(total.regenerated.items())]
    waits = total.admission
    return [
        LENGTH_SKEW_TRAJECTORIES.family(counts),
        LENGTH_SKEW_REGENERATED_TOKENS.family([((bucket_label(b),), n) for b, n in sorted(total.regenerated_tokens.items())]),
        LENGTH_SKEW_IN_FLIGHT.family([((bucket_label(b),), n) for b, n in sorted(in_flight.items())]),
        LENGTH_SKEW_STALENESS.summary([((bucket_label(b),), sum(h.values()), sum(k * n for k, n in h.items()))
                                       for b, h in sorted(total.staleness.items())]),
        ADMISSION_WAIT_SECONDS.summary([((), waits.admitted, waits.wait_s)]),
        ADMISSION_WAITED.value(waits.waited),
    ]


CATALOGUE: tuple[Metric, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Metric))
"""Every metric a StaleFlow service exports."""

Collector = Callable[[], Iterable[MetricFamily]]


class _Scrape:
    """Adapts a collector function to prometheus_client's registry protocol."""

    def __init__(self, collect: Collector):
        self._collect = collect

    def collect(self) -> Iterable[MetricFamily]:
        return self._collect()


def mount_metrics(app: Any, component: str, *collectors: Collector,
                  refresh: Callable[[], Awaitable[None]] | None = None) -> CollectorRegistry:
    """Serve ``GET /metrics`` on the FastAPI ``app`` of service ``component``: its collectors'
    metrics plus HTTP request counts and latencies. ``refresh`` is awaited before each scrape,
    for state only an async call can read (collectors themselves are synchronous). Returns the
    app's registry (for more collectors later: ``registry.register(...)``)."""
    from fastapi.responses import Response

    registry = CollectorRegistry()
    started = time.time()
    registry.register(_Scrape(lambda: [COMPONENT_INFO.value(1, component), COMPONENT_STARTED.value(started, component)]))
    for collect in collectors:
        registry.register(_Scrape(collect))
    requests = Counter(HTTP_REQUESTS.name, HTTP_REQUESTS.help, list(HTTP_REQUESTS.labels), registry=registry)
    latency = Histogram(HTTP_SECONDS.name, HTTP_SECONDS.help, list(HTTP_SECONDS.labels), registry=registry,
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

    app.add_middleware(_RequestMetrics, component=component, requests=requests, latency=latency)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        if refresh is not None:
            await refresh()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    app.state.metrics_registry = registry
    return registry


class _RequestMetrics:
    """Plain ASGI middleware (streamed bodies, e.g. weights, pass through untouched): counts each
    HTTP request by its route template (``/v1/params/{version}``, not every id) and status."""

    def __init__(self, app: Any, component: str, requests: Counter, latency: Histogram):
        self.app, self.component, self.requests, self.latency = app, component, requests, latency
        # the labelled series of each (method, route, status): ``labels()`` costs a lock and a lookup per call
        self._series: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        begun = time.perf_counter()
        status = [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = getattr(scope.get("route"), "path", None) or "unmatched"  # the router sets it on the scope
            if path != "/metrics":
                key = (scope["method"], path, status[0])
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = (self.requests.labels(self.component, key[0], path, str(key[2])),
                                                  self.latency.labels(self.component, key[0], path))
                series[0].inc()
                series[1].observe(time.perf_counter() - begun)


def exported_series(text: str) -> set[str]:
    """The sample names in a Prometheus text exposition (``name_total``, ``name_bucket``, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


__all__ = ["CATALOGUE", "Collector", "Metric", "exported_series", "mount_metrics"]
