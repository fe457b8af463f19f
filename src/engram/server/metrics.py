"""Prometheus metrics. Engine gauges and counters are read from `AsyncEngine.stats()` at scrape
time; latency histograms are observed by the server as outputs stream out. Every series carries
the served model's name as its `model_name` label, as vLLM's do."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engram.engine.async_engine import AsyncEngine
from engram.engine.request import RequestOutput
from engram.state.conversations import ConversationManager
from engram.state.store import Histogram as StoreHistogram

log = logging.getLogger("engram.server.requests")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        stats = engine.stats()
        self._last = (time.monotonic(), stats.prefill_tokens_computed_total, stats.generation_tokens_total)

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        now = time.monotonic()
        then, prefill_then, gen_then = self._last
        self._last = (now, s.prefill_tokens_computed_total, s.generation_tokens_total)
        elapsed = max(now - then, 1e-9)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"engram:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"engram:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            return family

        yield gauge("num_running_reqs", "requests being prefilled or decoded", s.num_running)
        yield gauge("num_queue_reqs", "requests waiting for a state slot", s.num_waiting)
        yield counter("prompt_tokens", "prompt tokens received", s.prompt_tokens_total)
        yield counter("generation_tokens", "tokens generated", s.generation_tokens_total)
        yield counter("prefill_tokens_computed", "prompt tokens computed (not restored from state)", s.prefill_tokens_computed_total)
        yield counter("cached_tokens", "prompt tokens restored from state instead of computed", s.cached_tokens_total)
        by_source = CounterMetricFamily(
            "engram:prompt_tokens_by_source", "prompt tokens received, restored from state or computed", labels=["model_name", "source"]
        )
        by_source.add_metric([self.model_name, "restored"], s.cached_tokens_total)
        by_source.add_metric([self.model_name, "computed"], s.prompt_tokens_total - s.cached_tokens_total)
        yield by_source
        yield counter("captures", "states captured at a request's end (a turn's final state, a prompt's state)", s.captures_total)
        yield counter(
            "capture_bytes",
            "bytes those captures copied device to host: the KV the host lacked and the recurrent state (per turn: the ratio of the two)",
            s.capture_bytes_total,
        )
        yield counter(
            "prefix_cache_slot_hits",
            "requests whose prompt's prefix was still in a finished request's engine slot (the GPU tier)",
            s.prefix_slot_hits_total,
        )
        yield counter("num_preemptions", "running requests preempted (their state dropped, recomputed later)", s.num_preemptions)
        yield counter("graph_captures", "CUDA graphs captured", s.graph_captures)
        yield counter("kernel_compilations", "Triton kernels compiled", s.kernel_compilations)
        yield counter(
            "compilations_after_ready",
            "graph captures and kernel compilations after warm-up (on a request's path; should stay 0)",
            s.compilations_after_ready,
        )
        yield gauge("prefill_throughput", "prefill tokens/s since the previous scrape", (s.prefill_tokens_computed_total - prefill_then) / elapsed)
        yield gauge("gen_throughput", "generated tokens/s since the previous scrape", (s.generation_tokens_total - gen_then) / elapsed)
        yield gauge("state_slots_used", "recurrent-state slots in use, retained ones included", s.state_slots_used)
        yield gauge("state_slots_total", "recurrent-state slots", s.state_slots_total)
        yield gauge("retained_slots", "finished requests' slots kept, reclaimable (conversations' and the prefix cache's)", s.retained_slots)
        yield gauge("prefix_cache_slots", "of those, the prefix cache's (its GPU tier)", s.prefix_slots)
        # usage as vLLM's kv_cache_usage_perc: what requests hold, retained (reclaimable) entries counted as free
        yield gauge(
            "state_pool_usage", "fraction of state slots held by requests", (s.state_slots_used - s.retained_slots) / max(s.state_slots_total, 1)
        )
        yield gauge("kv_blocks_used", "KV pages in use, retained slots' included", s.kv_blocks_used)
        yield gauge("kv_blocks_retained", "KV pages that retained slots hold, reclaimable", s.kv_blocks_retained)
        yield gauge("kv_blocks_total", "KV pages", s.kv_blocks_total)
        yield gauge("kv_pool_usage", "fraction of KV pages held by requests", (s.kv_blocks_used - s.kv_blocks_retained) / max(s.kv_blocks_total, 1))
        if s.spec_accepted_per_position:  # speculative decoding on (vLLM's spec_decode_* series)
            yield counter("spec_decode_num_drafts", "verify rows with a draft", s.spec_drafts_total)
            yield counter("spec_decode_num_draft_tokens", "speculative tokens proposed and verified", s.spec_draft_tokens_total)
            yield counter("spec_decode_num_accepted_tokens", "speculative tokens kept", s.spec_accepted_tokens_total)
            per_pos = CounterMetricFamily(
                "engram:spec_decode_num_accepted_tokens_per_pos", "drafts whose token at this position was kept", labels=["model_name", "position"]
            )
            for position, accepted in enumerate(s.spec_accepted_per_position):
                per_pos.add_metric([self.model_name, str(position)], accepted)
            yield per_pos


class _StateCollector(Collector):
    """The conversation state tiers: usage, hits, moves, restore and write latencies, health."""

    def __init__(self, manager: ConversationManager, model_name: str) -> None:
        self.manager = manager
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        st = self.manager.state_stats()
        stats = self.manager.stats
        m = self.model_name
        tiers = GaugeMetricFamily("engram:state_tier_entries", "states held per tier", labels=["model_name", "tier"])
        tiers.add_metric([m, "active"], st["tiers"]["active"]["turns"])
        tiers.add_metric([m, "warm"], st["tiers"]["warm"]["states"])
        tiers.add_metric([m, "cold"], st["tiers"]["cold"]["snapshots_known"])
        yield tiers
        warm = GaugeMetricFamily("engram:state_warm_bytes", "bytes of states in host memory", labels=["model_name"])
        warm.add_metric([m], st["tiers"]["warm"]["bytes"])
        yield warm
        hits = CounterMetricFamily("engram:state_tier_hits", "continuations served from each tier", labels=["model_name", "tier"])
        for tier, n in st["hits"].items():
            hits.add_metric([m, tier], n)
        yield hits
        misses = CounterMetricFamily("engram:state_misses", "continuations that recomputed the whole history", labels=["model_name"])
        misses.add_metric([m], st["misses"])
        yield misses
        moves = CounterMetricFamily("engram:state_tier_moves", "promotions and demotions between tiers", labels=["model_name", "move"])
        for move, n in {**st["promotions"], **st["demotions"]}.items():
            moves.add_metric([m, move], n)
        yield moves
        restore = HistogramMetricFamily(
            "engram:state_restore_seconds", "time to bring a state into the engine, per tier", labels=["model_name", "tier"]
        )
        for tier, h in stats.restore_seconds.items():
            restore.add_metric([m, tier], _buckets(h), h.total)
        yield restore
        write = HistogramMetricFamily("engram:snapshot_write_seconds", "time to write a snapshot file", labels=["model_name"])
        write.add_metric([m], _buckets(stats.snapshot_write_seconds), stats.snapshot_write_seconds.total)
        yield write
        failures = CounterMetricFamily("engram:snapshot_write_failures", "snapshot writes that failed", labels=["model_name"])
        failures.add_metric([m], st["snapshot_write_failures"])
        yield failures
        if st["store"] is not None:
            written = CounterMetricFamily(
                "engram:snapshot_bytes_written", "bytes of store files written (KV pieces, checkpoints)", labels=["model_name"]
            )
            written.add_metric([m], st["store"]["bytes_written"])
            yield written
            reused = CounterMetricFamily(
                "engram:snapshot_files_reused", "store files a save found stored already (shared prefixes)", labels=["model_name"]
            )
            reused.add_metric([m], st["store"]["files_reused"])
            yield reused
        if st["prefix_cache"] is not None:
            lookups = CounterMetricFamily("engram:prefix_cache_queries", "prefix cache lookups, and those that hit", labels=["model_name", "result"])
            lookups.add_metric([m, "hit"], st["prefix_cache"]["hits"])
            lookups.add_metric([m, "miss"], st["prefix_cache"]["lookups"] - st["prefix_cache"]["hits"])
            yield lookups
            disk_hits = CounterMetricFamily(
                "engram:prefix_cache_disk_hits", "prefix cache hits whose state was read from the disk tier", labels=["model_name"]
            )
            disk_hits.add_metric([m], st["prefix_cache"]["disk_hits"])
            yield disk_hits
            held = GaugeMetricFamily("engram:prefix_cache_bytes", "bytes of states in the prefix cache", labels=["model_name"])
            held.add_metric([m], st["prefix_cache"]["bytes"])
            yield held
        health = CounterMetricFamily("engram:state_health_events", "state health checks and failures", labels=["model_name", "event"])
        for event, n in st["health"].items():
            health.add_metric([m, event], n)
        yield health


def _buckets(h: StoreHistogram) -> list[tuple[str, float]]:
    cumulative = 0
    out: list[tuple[str, float]] = []
    for bound, count in zip((*h.buckets, float("inf")), h.counts):
        cumulative += count
        out.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    return out


class Metrics:
    """One registry per app, so several servers can live in one process (tests)."""

    def __init__(self, engine: AsyncEngine, manager: ConversationManager, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.registry.register(_StateCollector(manager, model_name))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)

        self.ttft = histogram("engram:time_to_first_token_seconds", "time from arrival to the first token")
        self.itl = histogram("engram:inter_token_latency_seconds", "time between consecutive output tokens")
        self.e2e = histogram("engram:e2e_request_latency_seconds", "time from arrival to the last token")
        self.queue = histogram("engram:request_queue_time_seconds", "time from reaching the engine thread to being admitted to a step")

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, conversation_id: str | None = None) -> RequestTimer:
        return RequestTimer(self, conversation_id)


class RequestTimer:
    """A request's latencies, observed as its outputs stream out; a log line when it finishes."""

    def __init__(self, metrics: Metrics, conversation_id: str | None = None) -> None:
        self.metrics = metrics
        self.conversation_id = conversation_id
        self.arrival = self._last = time.perf_counter()
        self._seen_token = False
        self._ttft: float | None = None
        self._queue: float | None = None

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if self._queue is None and out.queue_seconds is not None:
            self._queue = out.queue_seconds
            self.metrics.queue.observe(out.queue_seconds)
        if out.new_token_ids:
            if self._seen_token:
                per_token = (now - self._last) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.metrics.itl.observe(per_token)
            else:
                self._ttft = now - self.arrival
                self.metrics.ttft.observe(self._ttft)
                self._seen_token = True
            self._last = now
        if out.finished:
            self.metrics.e2e.observe(now - self.arrival)
            self._log(out, now - self.arrival)

    def _log(self, out: RequestOutput, e2e: float) -> None:
        ttft = f"{self._ttft * 1e3:.1f}" if self._ttft is not None else "-"
        queue = f"{self._queue * 1e3:.1f}" if self._queue is not None else "-"
        log.info(
            "request %s conversation=%s prompt=%d cached=%d generated=%d queue_ms=%s ttft_ms=%s e2e_ms=%.1f finish=%s",
            out.request_id,
            self.conversation_id or "-",
            len(out.prompt_token_ids),
            out.num_cached_tokens,
            len(out.token_ids),
            queue,
            ttft,
            e2e * 1e3,
            out.finish_reason.value if out.finish_reason else "-",
        )
