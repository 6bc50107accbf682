"""Every shipped plugin type: importing a module registers its types (`registry.plugin`).
A new plugin is one file plus its line here."""

from sluice.gateway.routing import admitters, data_layer, flow_policies, latency  # noqa: F401
from sluice.gateway.routing.filters import (  # noqa: F401
    imbalance,
    known_load,
    kv_ceiling,
    roles,
)
from sluice.gateway.routing.pickers import (  # noqa: F401
    max_score,
    random_picker,
    round_robin,
    weighted_random,
)
from sluice.gateway.routing.profiles import deciders, pd, single  # noqa: F401
from sluice.gateway.routing.scorers import (  # noqa: F401
    active_request,
    approx_prefix_cache,
    cache_room,
    kv_cache_utilization,
    load_aware,
    lora_affinity,
    no_hit_lru,
    precise_prefix_cache,
    prefill_cost,
    prefix_cache,
    queue,
    request_queue,
    running_requests,
    session_affinity,
    token_load,
)
