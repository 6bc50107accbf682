"""`sluice bench engine` runs end to end on a tiny shape (a smoke test, not a timing)."""

from __future__ import annotations

import json

import pytest

from sluice.cli import main

pytestmark = pytest.mark.slow  # full engine benchmark runs, one against transformers


def test_throughput_mode(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "engine", "--load-format", "dummy", "--model", "tiny-llama",
                 "--num-seqs", "6", "--min-len", "4", "--max-len", "24", "--block-size", "4",
                 "--num-kv-blocks", "24", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["output_tokens"] > 0 and result["output_tok_s"] > 0
    assert result["preemptions"] > 0  # 96 slots for 6 x up to 48 tokens


def test_latency_mode_compares_with_transformers(tmp_path):
    out = tmp_path / "l.json"
    assert main(["bench", "engine", "--mode", "latency", "--load-format", "dummy", "--model",
                 "tiny-qwen3", "--input-len", "16", "--output-len", "4", "--compare", "hf",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hf_tpot_ms"] > 0 and result["tpot_ratio_ours_over_hf"] > 0
