"""Flow control for the endpoint picker: while a pool is saturated, requests wait in
bounded per-priority queues, shared fairly between tenants, or are shed (GIE's flow
control and saturation detector)."""

from sluice.gateway.flow.config import FlowControlConfig, PriorityBandConfig
from sluice.gateway.flow.controller import Admitted, FlowController, Shed
from sluice.gateway.flow.saturation import SaturationDetector, SaturationDetectorConfig

__all__ = ["Admitted", "FlowControlConfig", "FlowController", "PriorityBandConfig",
           "SaturationDetector", "SaturationDetectorConfig", "Shed"]
