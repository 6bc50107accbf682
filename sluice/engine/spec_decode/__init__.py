"""Speculative decoding: proposers draft tokens, the target verifies them in one step."""
