"""The engines' KV-cache events (vLLM's ZMQ wire format): subscription, replay, translation into index keys."""
