"""GET /metrics: the engine's counters read at scrape time, as Prometheus gauges."""

import time

from prometheus_client.core import GaugeMetricFamily


class EngineMetrics:
    """Prometheus collector (register it with a CollectorRegistry): one gauge per engine counter."""

    def __init__(self, source, started: float):
        self.source = source  # the engine or its client: metrics() gives the engine's counters
        self.started = started  # time.time() at start-up, for the tokens-per-second rate

    def collect(self):
        """Prometheus collector: read the engine's counters at scrape time."""
        m = self.source.metrics()
        uptime = max(time.time() - self.started, 1e-9)
        for name, value, doc in [
            (
                "rlkjax_requests_total",
                m["requests"],
                "requests submitted to the engine (= finished + cancelled + failed at rest)",
            ),
            (
                "rlkjax_requests_finished_total",
                m["finished"],
                "requests whose every sample stopped or reached its length",
            ),
            (
                "rlkjax_requests_cancelled_total",
                m["cancelled"],
                "requests cancelled: client gone, timeout, refused, shutdown",
            ),
            ("rlkjax_requests_failed_total", m["failed"], "requests failed by an engine error"),
            ("rlkjax_generated_tokens_total", m["decode_tokens"], "tokens sampled"),
            ("rlkjax_prefill_tokens_total", m["prefill_tokens"], "prompt tokens prefilled"),
            ("rlkjax_tokens_per_second", m["decode_tokens"] / uptime, "sampled tokens per second since start"),
            ("rlkjax_queue_depth", m["queue_depth"], "sequences waiting for admission"),
            ("rlkjax_running_sequences", m["running"], "sequences in flight"),
            ("rlkjax_kv_pages_used", m["pages_used"], "KV pages in use"),
            ("rlkjax_kv_pages_total", m["pages_total"], "KV pages available"),
            ("rlkjax_preemptions_total", m["preemptions"], "sequences preempted for pages"),
            (
                "rlkjax_preempted_tokens_total",
                m["preempted_tokens"],
                "positions whose KV pages preempted sequences gave back (prefilled again on return)",
            ),
            ("rlkjax_decode_rounds_total", m["decode_rounds"], "decode rounds run"),
            ("rlkjax_decode_rows_total", m["decode_rows"], "their rows: / rounds = sequences decoding together"),
            (
                "rlkjax_prefix_cache_lookups_total",
                m["prefix_cache_lookups"],
                "sequences admitted after a prefix-cache lookup",
            ),
            (
                "rlkjax_prefix_cache_hits_total",
                m["prefix_cache_hits"],
                "of those, sequences that found a cached prefix",
            ),
            (
                "rlkjax_prefix_cache_query_tokens_total",
                m["prefix_cache_query_tokens"],
                "prompt positions those lookups asked for (prefilled without the cache)",
            ),
            (
                "rlkjax_prefix_cache_hit_tokens_total",
                m["prefix_cache_hit_tokens"],
                "positions the prefix cache held: prefill tokens saved",
            ),
            ("rlkjax_prefix_cache_hit_rate", m["prefix_cache_hit_rate"], "hit tokens / query tokens since start"),
            ("rlkjax_prefix_cache_pages", m["prefix_cache_pages"], "KV pages the prefix cache keeps (unheld: free)"),
            ("rlkjax_prefix_cache_evictions_total", m["prefix_cache_evictions"], "kept pages evicted for new ones"),
            ("rlkjax_compiled_shapes", m["compiled_shapes"], "step-function shapes compiled (one compilation each)"),
            ("rlkjax_policy_version", m["policy_version"], "weights version"),
            ("rlkjax_engine_steps_total", m["steps"], "scheduling steps (one decode round and/or prefill chunk each)"),
            ("rlkjax_engine_step_seconds_total", m["step_s"], "seconds the engine spent in scheduling steps"),
            ("rlkjax_engine_wait_seconds_total", m["wait_s"], "of those, blocked on a decode round"),
            ("rlkjax_engine_gap_seconds_total", m["gap_s"], "from reading a decode round to dispatching the next"),
            ("rlkjax_engine_dispatch_seconds_total", m["dispatch_s"], "inside the jitted calls' dispatch"),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)
