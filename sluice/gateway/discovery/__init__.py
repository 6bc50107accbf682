"""Which engine pods exist (static list or Kubernetes), what they serve, and whether they are healthy."""
