"""`sluice bench step` runs end to end on a tiny shape (a smoke test, not a timing)."""

from __future__ import annotations

import json

from sluice.cli import main


def test_step_phases_ops_and_prefill(tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "step", "--load-format", "dummy", "--model", "tiny-llama",
                 "--batch-size", "3", "--min-len", "5", "--max-len", "20", "--steps", "2",
                 "--profile-ops", "1", "--prefill-tokens", "40", "--num-kv-blocks", "64",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["batch_size"] == 3 and result["attention_backend"] == "CpuAttentionBackend"
    assert result["step_ms"] >= result["forward_ms"] > 0
    assert result["prefill_alone_ms"] > 0 and result["prefill_with_batch_ms"] > 0
    assert result["ops_ms"]
