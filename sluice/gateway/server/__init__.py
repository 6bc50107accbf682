"""The endpoint picker's servers: Envoy's ext_proc protocol and gRPC health."""
