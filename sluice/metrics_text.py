"""The vLLM metrics of an engine's `/metrics` page that routing and autoscaling read:
one parser (prometheus_client's), for the picker and the operator alike.

Counts are summed over series (`model_name`, `engine` label values); the KV-usage
fraction is their mean: a data-parallel vLLM server exports one series per engine,
each a fraction of its own cache, so a sum would read above 1. Only the lines of
the names below are handed to the parser: a page holds hundreds of histogram lines
and this runs every 150 ms per pod. A leaf module: no torch, no web framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, old name
_SUMMED = ("vllm:num_requests_waiting", "vllm:num_requests_running",
           "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
_INFO = "vllm:cache_config_info"
# vLLM's LoRA gauge: one series per state change, its value the time of the change; the
# newest says which adapters run and wait (comma lists) and the batch's adapter limit
LORA_INFO = "vllm:lora_requests_info"
_WANTED = tuple(f"{n}{end}" for n in (*KV_USAGE, *_SUMMED, _INFO, LORA_INFO)
                for end in ("{", " "))


@dataclass(frozen=True)
class EngineMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_hits: float = 0.0      # tokens (counter)
    prefix_queries: float = 0.0   # tokens (counter)
    reports_kv: bool = False      # the page has a KV-usage gauge at all
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    max_loras: int | None = None  # None: the page has no LoRA gauge


def parse_engine_metrics(text: str) -> EngineMetrics:
    lines = [line for line in text.splitlines() if line.startswith(_WANTED)]
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    info: dict[str, str] = {}
    lora: tuple[float, dict[str, str]] | None = None
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except ValueError:  # a page that is not Prometheus text
        families = []
    for family in families:
        for sample in family.samples:
            if sample.name == _INFO:
                info = dict(sample.labels)
                continue
            if sample.name == LORA_INFO:
                if lora is None or sample.value >= lora[0]:
                    lora = (sample.value, dict(sample.labels))
                continue
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            counts[sample.name] = counts.get(sample.name, 0) + 1
    kv_name = next((n for n in KV_USAGE if n in sums), None)

    def as_int(s: str | None) -> int | None:
        return int(s) if s and s.isdigit() else None

    def names(s: str | None) -> frozenset[str]:
        return frozenset(n for n in (s or "").split(",") if n)

    lora_labels = lora[1] if lora is not None else {}

    return EngineMetrics(
        waiting=sums.get("vllm:num_requests_waiting", 0.0),
        running=sums.get("vllm:num_requests_running", 0.0),
        kv_usage=sums[kv_name] / counts[kv_name] if kv_name else 0.0,
        block_size=as_int(info.get("block_size")),
        num_gpu_blocks=as_int(info.get("num_gpu_blocks")),
        prefix_hits=sums.get("vllm:prefix_cache_hits_total", 0.0),
        prefix_queries=sums.get("vllm:prefix_cache_queries_total", 0.0),
        reports_kv=kv_name is not None,
        running_loras=names(lora_labels.get("running_lora_adapters")),
        waiting_loras=names(lora_labels.get("waiting_lora_adapters")),
        max_loras=as_int(lora_labels.get("max_lora")))
