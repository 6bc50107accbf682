"""Scorers: a score in [0, 1] per candidate, higher is better (`plugins.Scorer`)."""
