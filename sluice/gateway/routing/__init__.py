"""Routing: filters -> scorers -> picker, assembled into strategies."""
