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
                 enable_prefix_caching: bool):
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
              ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
              registry=r).labels(m, str(block_size), str(num_blocks),
                                 str(enable_prefix_caching)).set(1)
        Gauge("vllm:lora_requests_info", "LoRA adapters in use",
              ["model_name", "running_lora_adapters", "waiting_lora_adapters",
               "max_lora"], registry=r).labels(m, "", "", "0").set(time.time())
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

    def on_step(self, num_running: int, num_waiting: int, kv_usage: float, num_preempted: int,
                prefix_queries: int, prefix_hits: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.gpu_usage.set(kv_usage)
        self.preemptions.inc(num_preempted)
        self.prefix_queries.inc(prefix_queries)
        self.prefix_hits.inc(prefix_hits)

    def on_token(self, req: Request, now: float) -> None:
        self.generation_tokens.inc()
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
