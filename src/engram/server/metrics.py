"""Prometheus metrics. Engine gauges and counters are read from `AsyncEngine.stats()` at scrape
time; latency histograms are observed by the server as outputs stream out."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engram.engine.async_engine import AsyncEngine
from engram.engine.request import RequestOutput
from engram.state.conversations import ConversationManager
from engram.state.store import Histogram as StoreHistogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        stats = engine.stats()
        self._last = (time.monotonic(), stats.prefill_tokens_computed_total, stats.generation_tokens_total)

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        now = time.monotonic()
        then, prefill_then, gen_then = self._last
        self._last = (now, s.prefill_tokens_computed_total, s.generation_tokens_total)
        elapsed = max(now - then, 1e-9)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"engram:{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"engram:{name}", doc, value=value)

        yield gauge("num_running_reqs", "requests being prefilled or decoded", s.num_running)
        yield gauge("num_queue_reqs", "requests waiting for a state slot", s.num_waiting)
        yield counter("prompt_tokens", "prompt tokens received", s.prompt_tokens_total)
        yield counter("generation_tokens", "tokens generated", s.generation_tokens_total)
        yield counter("prefill_tokens_computed", "prompt tokens computed (not restored from state)", s.prefill_tokens_computed_total)
        yield counter("cached_tokens", "prompt tokens restored from state instead of computed", s.cached_tokens_total)
        yield gauge("prefill_throughput", "prefill tokens/s since the previous scrape", (s.prefill_tokens_computed_total - prefill_then) / elapsed)
        yield gauge("gen_throughput", "generated tokens/s since the previous scrape", (s.generation_tokens_total - gen_then) / elapsed)
        yield gauge("state_slots_used", "recurrent-state slots in use", s.state_slots_used)
        yield gauge("state_slots_total", "recurrent-state slots", s.state_slots_total)
        yield gauge("state_pool_usage", "fraction of state slots in use", s.state_slots_used / max(s.state_slots_total, 1))
        yield gauge("kv_blocks_used", "KV pages in use", s.kv_blocks_used)
        yield gauge("kv_blocks_total", "KV pages", s.kv_blocks_total)
        yield gauge("kv_pool_usage", "fraction of KV pages in use", s.kv_blocks_used / max(s.kv_blocks_total, 1))


class _StateCollector(Collector):
    """The conversation state tiers: usage, hits, moves, restore and write latencies, health."""

    def __init__(self, manager: ConversationManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        st = self.manager.state_stats()
        stats = self.manager.stats
        tiers = GaugeMetricFamily("engram:state_tier_entries", "states held per tier", labels=["tier"])
        tiers.add_metric(["active"], st["tiers"]["active"]["turns"])
        tiers.add_metric(["warm"], st["tiers"]["warm"]["states"])
        tiers.add_metric(["cold"], st["tiers"]["cold"]["snapshots_known"])
        yield tiers
        yield GaugeMetricFamily("engram:state_warm_bytes", "bytes of states in host memory", value=st["tiers"]["warm"]["bytes"])
        hits = CounterMetricFamily("engram:state_tier_hits", "continuations served from each tier", labels=["tier"])
        for tier, n in st["hits"].items():
            hits.add_metric([tier], n)
        yield hits
        yield CounterMetricFamily("engram:state_misses", "continuations that recomputed the whole history", value=st["misses"])
        moves = CounterMetricFamily("engram:state_tier_moves", "promotions and demotions between tiers", labels=["move"])
        for move, n in {**st["promotions"], **st["demotions"]}.items():
            moves.add_metric([move], n)
        yield moves
        restore = HistogramMetricFamily("engram:state_restore_seconds", "time to bring a state into the engine, per tier", labels=["tier"])
        for tier, h in stats.restore_seconds.items():
            restore.add_metric([tier], _buckets(h), h.total)
        yield restore
        write = HistogramMetricFamily("engram:snapshot_write_seconds", "time to write a snapshot file")
        write.add_metric([], _buckets(stats.snapshot_write_seconds), stats.snapshot_write_seconds.total)
        yield write
        yield CounterMetricFamily("engram:snapshot_write_failures", "snapshot writes that failed", value=st["snapshot_write_failures"])
        health = CounterMetricFamily("engram:state_health_events", "state health checks and failures", labels=["event"])
        for event, n in st["health"].items():
            health.add_metric([event], n)
        yield health


def _buckets(h: StoreHistogram) -> list[tuple[str, float]]:
    cumulative, out = 0, []
    for bound, count in zip((*h.buckets, float("inf")), h.counts):
        cumulative += count
        out.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    return out


class Metrics:
    """One registry per app, so several servers can live in one process (tests)."""

    def __init__(self, engine: AsyncEngine, manager: ConversationManager) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.registry.register(_StateCollector(manager))
        self.ttft = Histogram("engram:time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("engram:inter_token_latency_seconds", "time between consecutive output tokens",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("engram:e2e_request_latency_seconds", "time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.arrival = self._last = time.perf_counter()
        self._seen_token = False

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            if self._seen_token:
                per_token = (now - self._last) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.metrics.itl.observe(per_token)
            else:
                self.metrics.ttft.observe(now - self.arrival)
                self._seen_token = True
            self._last = now
        if out.finished:
            self.metrics.e2e.observe(now - self.arrival)
