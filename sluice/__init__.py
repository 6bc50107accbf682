"""Sluice: Kubernetes-native LLM serving (engine, gateway, operator)."""

__version__ = "0.1.0"
