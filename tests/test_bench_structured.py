"""`sluice bench structured` runs end to end on the tiny chat model (a smoke test, not a
timing: the figures of record are in docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from sluice.cli import main

pytest.importorskip("xgrammar")


def test_structured_bench_reports_the_added_sampler_time(tiny_chat_model, tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "structured", "--model", str(tiny_chat_model), "--num-kv-blocks",
                 "256", "--batch-size", "8", "--constrained", "4", "--steps", "3",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["constrained"] == 4 and r["steps"] == 3
    assert r["sampler_constrained_ms"] > 0 and r["sampler_unconstrained_ms"] > 0
    assert r["unconstrained_step_ms"] > 0
    assert r["added_over_step"] == pytest.approx(
        r["added_sampler_ms"] / r["unconstrained_step_ms"])
