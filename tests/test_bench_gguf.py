"""`sluice bench gguf` runs end to end on the portable kernel build (a smoke test, not a timing)."""

from __future__ import annotations

from sluice.cli import main


def test_every_type_and_shape_is_timed(capsys):
    assert main(["bench", "gguf", "--isa", "portable", "--calls", "3"]) == 0
    out = capsys.readouterr().out
    # 576 wide has no K-quant form: only Q4_1 is timed there
    assert "576 x 1536: bf16" in out and "Q4_K -, Q5_K -, Q6_K -, Q4_1 0." in out
    assert out.count("Q4_K 0.") == 2  # 768 x 1536 and 1536 x 576
