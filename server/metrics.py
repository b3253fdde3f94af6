"""Prometheus metrics with vLLM's names, in a registry owned by one app.

Gauges and cumulative counters are read from the engine snapshot at scrape time by a custom
collector (so they are exactly the engine's numbers); latency histograms are observed by the
engine loop thread as outputs arrive. A small stat logger prints vLLM-style throughput and
speculative-decoding lines every ``log_interval`` seconds while there is traffic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from server.engine_types import EngineSnapshot

log = logging.getLogger("specserve.stats")

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    def __init__(self, labels: dict[str, str], snapshot: Callable[[], EngineSnapshot],
                 cache_info: dict[str, str], speculative: bool) -> None:
        self._names = list(labels)
        self._values = list(labels.values())
        self._snapshot = snapshot
        self._cache_info = cache_info
        self._speculative = speculative

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=self._names)
        family.add_metric(self._values, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self._names)
        family.add_metric(self._values, value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          s.running)
        yield self._gauge("vllm:num_requests_waiting",
                          "Requests waiting to be scheduled (preempted included).", s.waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
                          s.kv_usage)
        yield self._gauge("vllm:gpu_cache_usage_perc",
                          "Deprecated alias of vllm:kv_cache_usage_perc.", s.kv_usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration.",
                                 labels=[*self._names, *self._cache_info, "num_gpu_blocks"])
        info.add_metric([*self._values, *self._cache_info.values(), str(s.num_blocks)], 1.0)
        yield info
        yield self._counter("vllm:prompt_tokens", "Prefilled prompt tokens.", s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield self._counter("vllm:num_preemptions", "Preemptions (recompute).",
                            s.num_preemptions)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by reason.",
                                      labels=[*self._names, "finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(s.finished)):
            success.add_metric([*self._values, reason], s.finished.get(reason, 0))
        yield success
        if not self._speculative:
            return
        yield self._counter("vllm:spec_decode_num_drafts", "Verified drafts.", s.num_drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                            s.num_draft_tokens)
        yield self._counter("vllm:spec_decode_num_accepted_tokens",
                            "Draft tokens accepted (bonus token excluded).",
                            s.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens per position.",
                                      labels=[*self._names, "position"])
        for pos, count in enumerate(s.accepted_per_pos):
            per_pos.add_metric([*self._values, str(pos)], count)
        yield per_pos
        by_k = CounterMetricFamily(
            "specserve:spec_decode_verify_steps",
            "Sampling steps of a request by the number k of drafts the speculation controller "
            "had it verify (k = 0: a plain decode).", labels=[*self._names, "k"])
        for k, count in enumerate(s.steps_by_k):
            by_k.add_metric([*self._values, str(k)], count)
        yield by_k


class ServingMetrics:
    """The app's registry plus the engine observer that feeds it (see ``EngineObserver``)."""

    def __init__(
        self,
        model_name: str,
        snapshot: Callable[[], EngineSnapshot],
        cache_info: dict[str, str],
        speculative: bool = False,
        log_interval: float = 10.0,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              LABELS, buckets=TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive outputs of a request (one per step).",
                             LABELS, buckets=ITL_BUCKETS, registry=self.registry).labels(**labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             LABELS, buckets=E2E_BUCKETS, registry=self.registry).labels(**labels)
        self.registry.register(_EngineCollector(labels, snapshot, cache_info, speculative))
        timeouts = Counter("specserve:request_timeouts",
                           "Requests aborted by --request-timeout and answered with an error, "
                           "by stage (waiting: no token yet; generating: partial output).",
                           [*LABELS, "stage"], registry=self.registry)
        self._timeouts = {stage: timeouts.labels(**labels, stage=stage)
                          for stage in ("waiting", "generating")}
        self._last_output: dict[str, float] = {}  # loop thread only
        self._logger = StatLogger(log_interval) if log_interval > 0 else None

    # EngineObserver -------------------------------------------------------------------------
    def on_outputs(self, outputs: Sequence[RequestOutput], now: float) -> None:
        for out in outputs:
            m = out.metrics
            if out.num_new_tokens:
                prev = self._last_output.get(out.request_id)
                if prev is None:
                    first, arrival = m.get("first_token_time"), m.get("arrival_time")
                    if first is not None and arrival is not None:
                        self.ttft.observe(max(0.0, first - arrival))
                else:
                    self.itl.observe(max(0.0, now - prev))
                self._last_output[out.request_id] = now
            if out.finished:
                self._last_output.pop(out.request_id, None)
                if m.get("arrival_time") is not None:
                    self.e2e.observe(max(0.0, now - m["arrival_time"]))

    def on_timeout(self, stage: str) -> None:
        """A request timed out (event loop); ``stage`` is "waiting" or "generating"."""
        self._timeouts[stage].inc()

    def on_aborted(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._last_output.pop(rid, None)

    def on_tick(self, snapshot: EngineSnapshot, now: float) -> None:
        if self._logger is not None:
            self._logger.maybe_log(snapshot, now)


class StatLogger:
    """vLLM-style periodic log lines; mean acceptance length includes the bonus token."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: EngineSnapshot | None = None
        self._last_time = 0.0

    def maybe_log(self, s: EngineSnapshot, now: float) -> None:
        if self._last is None:
            self._last, self._last_time = s, now
            return
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        prev, self._last, self._last_time = self._last, s, now
        prompt = s.prompt_tokens - prev.prompt_tokens
        gen = s.generation_tokens - prev.generation_tokens
        if not (prompt or gen or s.running or s.waiting):
            return
        log.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                 "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Preemptions: %d",
                 prompt / elapsed, gen / elapsed, s.running, s.waiting, 100 * s.kv_usage,
                 s.num_preemptions)
        steps = [c - (prev.steps_by_k[k] if k < len(prev.steps_by_k) else 0)
                 for k, c in enumerate(s.steps_by_k)]
        if sum(steps):
            log.info("SpecDecoding choices: verified k = 0..%d drafts in %s of %d request steps",
                     len(steps) - 1, "/".join(str(n) for n in steps), sum(steps))
        drafts = s.num_drafts - prev.num_drafts
        if drafts <= 0:
            return
        drafted = s.num_draft_tokens - prev.num_draft_tokens
        accepted = s.num_accepted_tokens - prev.num_accepted_tokens
        per_pos = [(c - (prev.accepted_per_pos[i] if i < len(prev.accepted_per_pos) else 0))
                   / drafts for i, c in enumerate(s.accepted_per_pos)]
        log.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: "
                 "%.2f tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, "
                 "Drafted: %d tokens, Per-position acceptance rate: %s, Avg Draft acceptance "
                 "rate: %.1f%%", 1 + accepted / drafts, accepted / elapsed, drafted / elapsed,
                 accepted, drafted, ", ".join(f"{r:.3f}" for r in per_pos),
                 100 * accepted / drafted if drafted else 0.0)
