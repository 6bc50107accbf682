"""Prompt tokens as the engine computes them, and the request keys hashed from them."""
