"""Prometheus metrics under the names vLLM's dashboards and the Kubernetes inference gateway read.

Engine-wide counts (requests running and waiting, KV usage, tokens, preemptions, prefix cache)
are read from the step loop's latest snapshot of ``Engine.stats()`` when /metrics is scraped, so
they agree with ``stats()`` by construction; per-request latencies and outcomes are observed by
the handlers into histograms and a counter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmc.serve.loop import Snapshot

PREFIX = "llmc:"
# Buckets (seconds) as vLLM's, so the same dashboard panels apply.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


VLLM = "vllm:"
# What llm-d's endpoint picker reads from a vLLM pod by default, published under vLLM's own names beside llmc's so
# that it can route llmc pods too.


class _EngineCollector(Collector):
    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot], cache: dict[str, str] | None) -> None:
        self._model = model_name
        self._snapshot = snapshot
        self._cache = cache or {}

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        s = snap.stats
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            m.add_metric([self._model], value)
            return m

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            m.add_metric([self._model], value)
            return m

        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        for name, doc, value in (("num_requests_running", "Requests in the running batch.", s.num_running),
                                 ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                                 ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", usage)):
            m = GaugeMetricFamily(VLLM + name, doc + " (vLLM's name)", labels=labels)
            m.add_metric([self._model], value)
            yield m
        info = {**self._cache, "num_gpu_blocks": str(s.kv_blocks_total)}
        m = GaugeMetricFamily(VLLM + "cache_config_info", "KV-cache configuration (vLLM's name; value 1).",
                              labels=["model_name", *info])
        m.add_metric([self._model, *info.values()], 1.0)
        yield m
        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (including preempted ones).",
                    s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      snap.admitted_prompt_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.", s.cached_prompt_tokens)
        yield counter("prompt_tokens", "Prompt tokens of admitted requests (computed or served by the cache).",
                      snap.admitted_prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", s.generated_tokens)
        yield counter("num_preemptions", "Requests preempted (KV blocks freed, recomputed later).", s.num_preemptions)
        # Speculative decoding (as vLLM names them; zero when the engine does not speculate).
        yield counter("spec_decode_num_drafts", "Verify chunks: one per speculating request per step.",
                      s.spec_num_verify_steps)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.",
                      s.spec_num_accepted_tokens)
        max_lora = getattr(s, "max_lora", 0)
        if max_lora:  # vLLM's LoRA gauge (llm-d routes by it): adapters as label values, the value the scrape time
            m = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                  labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            m.add_metric([str(max_lora), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)],
                         time.time())
            yield m


class Metrics:
    """The server's registry: engine counters plus request histograms, labelled with the model name."""

    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot], cache: dict[str, str] | None = None) -> None:
        """``cache``: labels of ``vllm:cache_config_info`` (block_size, cache_dtype, enable_prefix_caching)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()  # no auto_describe: collect() only at scrape time
        self.registry.register(_EngineCollector(model_name, snapshot, cache))
        labels = ["model_name"]
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.", labels,
                             buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)

    # The step loop's Observer: called from its thread (prometheus-client's metrics are thread-safe).
    def first_token(self, ttft: float, queue_time: float | None) -> None:
        self.ttft.observe(ttft)
        if queue_time is not None:
            self.queue_time.observe(queue_time)

    def next_token(self, itl: float) -> None:
        self.itl.observe(itl)

    def finished(self, reason: str, e2e: float) -> None:
        # "cancelled" is what dashboards call "abort" (vLLM's label).
        self.request_success.labels(self.model_name, "abort" if reason == "cancelled" else reason).inc()
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
