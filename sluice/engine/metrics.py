"""Prometheus metrics under vLLM's names (label `model_name`), one registry per engine."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sluice.engine.request import Request

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str, block_size: int, num_blocks: int,
                 enable_prefix_caching: bool, max_loras: int = 0, cache_dtype: str = "auto"):
        self.registry = CollectorRegistry()
        r, labels, m = self.registry, ["model_name"], model_name

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(m)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(m)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(m)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full")
        self.gpu_usage = gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (deprecated name)")
        Gauge("vllm:cache_config_info", "KV-cache configuration",
              ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching",
               "cache_dtype"],
              registry=r).labels(m, str(block_size), str(num_blocks),
                                 str(enable_prefix_caching), cache_dtype).set(1)
        # vLLM's info gauge: the adapters of running and of waiting requests (names,
        # comma-separated) and --max-loras as labels, the time of the change as value.
        # Only the current label set is exported (readers take the latest series).
        self._lora_info = Gauge("vllm:lora_requests_info", "LoRA adapters in use",
                                ["model_name", "running_lora_adapters",
                                 "waiting_lora_adapters", "max_lora"], registry=r)
        self._lora_labels = (m, "", "", str(max_loras))
        self._lora_info.labels(*self._lora_labels).set(time.time())
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queries (tokens)")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits (tokens)")
        success = Counter("vllm:request_success", "Finished requests", ["model_name",
                          "finished_reason"], registry=r)
        self.success = {reason: success.labels(m, reason) for reason in ("stop", "length", "abort")}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", _LATENCY)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency", _ITL)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Time per output token (older name)", _ITL)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end latency", _LATENCY)
        self.queue = histogram("vllm:request_queue_time_seconds", "Time waiting", _LATENCY)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Prefill time", _LATENCY)
        self.decode = histogram("vllm:request_decode_time_seconds", "Decode time", _LATENCY)
        self._last_token_time: dict[str, float] = {}
        self.spec_drafts = counter("vllm:spec_decode_num_drafts",
                                   "Verifications of at least one draft token")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft",
                                     ["model_name", "position"], registry=r)
        self._model_name = m

    def on_step(self, num_running: int, num_waiting: int, kv_usage: float, num_preempted: int,
                prefix_queries: int, prefix_hits: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.gpu_usage.set(kv_usage)
        self.preemptions.inc(num_preempted)
        self.prefix_queries.inc(prefix_queries)
        self.prefix_hits.inc(prefix_hits)

    def on_lora(self, running: list[Request], waiting) -> None:
        def names(reqs) -> str:
            return ",".join(sorted({r.lora.name for r in reqs if r.lora is not None}))
        labels = (self._model_name, names(running), names(waiting), self._lora_labels[3])
        if labels != self._lora_labels:
            self._lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
            self._lora_info.labels(*labels).set(time.time())

    def enable_spec_decode(self, num_speculative_tokens: int) -> None:
        """Export the per-position counters from start-up (at 0), one per draft position."""
        for pos in range(num_speculative_tokens):
            self._spec_per_pos.labels(self._model_name, str(pos))

    def on_spec_decode(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: drafts 0 .. num_draft_tokens - 1 were checked and the
        first num_accepted of them accepted (vLLM counts per position from 0)."""
        assert 0 <= num_accepted <= num_draft_tokens
        if not num_draft_tokens:
            return
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(num_draft_tokens)
        self.spec_accepted.inc(num_accepted)
        for pos in range(num_accepted):
            self._spec_per_pos.labels(self._model_name, str(pos)).inc()

    def on_token(self, req: Request, now: float, num_tokens: int = 1) -> None:
        """num_tokens new tokens of req arrived at once (more than one: accepted drafts);
        the inter-token latency is observed once per arrival, as vLLM does."""
        self.generation_tokens.inc(num_tokens)
        last = self._last_token_time.get(req.request_id)
        if last is None:
            self.ttft.observe(now - req.arrival_time)
            self.prompt_tokens.inc(req.num_prompt_tokens)
        else:
            self.itl.observe(now - last)
            self.tpot.observe(now - last)
        self._last_token_time[req.request_id] = now

    def on_finished(self, req: Request, now: float) -> None:
        self._last_token_time.pop(req.request_id, None)
        self.success[req.finish_reason or "abort"].inc()
        self.e2e.observe(now - req.arrival_time)
        if req.first_scheduled_time is not None:
            self.queue.observe(req.first_scheduled_time - req.arrival_time)
            if req.first_token_time is not None:
                self.prefill.observe(req.first_token_time - req.first_scheduled_time)
                self.decode.observe(now - req.first_token_time)
