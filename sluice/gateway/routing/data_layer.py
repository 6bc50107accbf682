"""llm-d's and GIE's data-layer, parser and request-control plugin types whose work
Sluice's picker does built in, so that their configurations load unchanged:

- `metrics-data-source`, `core-metrics-extractor`: every discovered pod's `/metrics`
  is scraped (`load.scrape`, vLLM's names) and shared through Redis;
- `models-data-source`, `models-data-extractor`: every pod's `/v1/models` is read
  (`discovery.registry`), which is how a request's model selects its pool;
- `endpoint-notification-source`, `k8s-notification-source`: pods are watched through
  the Kubernetes API (`discovery.kubernetes`);
- `inflight-load-producer`: this picker's in-flight requests and pending prefill
  tokens per pod (`load.inflight`);
- `token-producer` (and its old name `tokenizer`): the prompt's token ids, from the
  picker's own tokenizers or a pod's `/tokenize` (`prompt.tokenize`);
- `openai-parser`: the OpenAI completions and chat bodies (`server.requests`);
- `prefill-header-handler`, `disagg-headers-handler`: `x-prefiller-host-port` is set
  from the prefill profile's target (`server.messages`).
Their parameters are accepted as written and do not change that behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.registry import plugin


@dataclass(frozen=True)
class AnyParams:
    """Parameters accepted and unused (see the module docstring)."""

    IGNORED = ("scheme", "path", "insecureSkipVerify", "engineLabelKey", "defaultEngine",
               "engineConfigs", "modelName", "vllm", "udsTokenizerConfig", "estimate",
               "prefillProfile", "encodeProfile", "requestTimeout", "group", "version",
               "kind")


class BuiltIn:
    """A configured plugin whose work the picker does built in."""

    def __init__(self, name: str, params: AnyParams, ctx: PluginContext) -> None:
        self.name = name


for _type in ("metrics-data-source", "core-metrics-extractor", "models-data-source",
              "models-data-extractor", "endpoint-notification-source",
              "k8s-notification-source", "inflight-load-producer", "token-producer",
              "openai-parser", "disagg-headers-handler"):
    plugin(_type, AnyParams, aliases={"token-producer": ("tokenizer",),
                                      "disagg-headers-handler": ("prefill-header-handler",)
                                      }.get(_type, ()))(
        type("".join(w.title() for w in _type.split("-")), (BuiltIn,), {}))
