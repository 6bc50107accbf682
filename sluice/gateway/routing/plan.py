"""A routing plan: what an EndpointPickerConfig builds (`config.load_plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from sluice.gateway.flow.config import FlowControlConfig
from sluice.gateway.flow.saturation import SaturationDetectorConfig
from sluice.gateway.routing.plugins import (
    DataProducer,
    PostResponse,
    PreRequest,
    ProfileHandler,
)
from sluice.gateway.routing.profile import SchedulingProfile


@dataclass
class RoutingPlan:
    name: str  # the configuration's name (metrics, the x-sluice-strategy header)
    plugins: dict[str, object]
    profiles: dict[str, SchedulingProfile]
    handler: ProfileHandler
    default_block_size: int = 16  # a pod's block size until it reports its own
    feature_gates: frozenset[str] = frozenset()
    saturation_detector: SaturationDetectorConfig = field(
        default_factory=SaturationDetectorConfig)
    flow_control: FlowControlConfig | None = None  # None: no flow control

    @property
    def uses_prompt(self) -> bool:
        """Whether any plugin reads the prompt's tokens (else none are tokenized)."""
        return any(getattr(p, "uses_prompt", False) for p in self.plugins.values())

    @property
    def uses_events(self) -> bool:
        """Whether any plugin reads the event-fed index (else no events are read)."""
        return any(getattr(p, "uses_events", False) for p in self.plugins.values())

    @cached_property
    def producers(self) -> list[DataProducer]:
        return [p for p in self.plugins.values() if isinstance(p, DataProducer)]

    @cached_property
    def pre_request_hooks(self) -> list[PreRequest]:
        return [p for p in self.plugins.values() if isinstance(p, PreRequest)]

    def renewer(self):
        """The plugin that renews a running request's speculative entries, or None."""
        return next((p for p in self.plugins.values() if hasattr(p, "renew")), None)

    @cached_property
    def request_headers(self) -> frozenset[str]:
        """The request headers (lower-case) plugins read (`reads_headers`)."""
        return frozenset().union(*(getattr(p, "reads_headers", ()) for p in
                                   self.plugins.values()))

    @cached_property
    def response_header_plugins(self) -> list:
        """Plugins that add headers to the answer (session affinity's token)."""
        return [p for p in self.plugins.values() if hasattr(p, "response_headers")]

    @cached_property
    def post_response_hooks(self) -> list[PostResponse]:
        return [p for p in self.plugins.values() if isinstance(p, PostResponse)]
