"""The P/D benchmark through the stack (`sluice.bench.pd_stack`): its window and phase
bookkeeping (pure), and one tiny run of the CLI through two real stacks."""

import json
import math

import pytest

from sluice.bench.pd_stack import long_prompts
from sluice.bench.pd_stack_stats import (
    add_ratios,
    format_table,
    metric_sum,
    percentile,
    phase_row,
    token_times,
    window_gaps,
    window_tokens,
)
from sluice.bench.serve_client import Result


def stream(start: float, ttft: float, itl: list[float], pd: str | None = "short") -> Result:
    return Result(ok=True, start=start, ttft=ttft, itl=itl, output_tokens=len(itl) + 1, pd=pd)


def test_token_times_and_window():
    r = stream(10.0, 0.5, [0.1, 0.2, 0.3])
    assert token_times(r) == pytest.approx([10.5, 10.6, 10.8, 11.1])
    assert token_times(Result(ok=False, start=3.0)) == []
    # gaps ending in [10.6, 11.1): 10.6 and 10.8, not 11.1 (end excluded)
    assert window_gaps([r], 10.6, 11.1) == pytest.approx([0.1, 0.2])
    assert window_gaps([r], 10.55, 11.2) == pytest.approx([0.1, 0.2, 0.3])
    # the first token closes no gap, but it is a token of the window
    assert window_gaps([r], 10.0, 10.55) == [] and window_tokens([r], 10.0, 10.55) == 1
    assert window_tokens([r, stream(10.7, 0.0, [0.05])], 10.6, 11.0) == 4


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile(values, 100) == 100 and percentile([7.0], 99) == 7.0
    assert percentile(values * 10, 99.9) == 100 and percentile(values * 10, 99) == 99
    assert math.isnan(percentile([], 99))


def test_metric_sum_matches_name_and_label():
    text = """# HELP sluice:kv_transfer_time_seconds Time of one KV pull
sluice:kv_transfer_time_seconds_sum{direction="received",model_name="m"} 1.5
sluice:kv_transfer_time_seconds_sum{direction="sent",model_name="m"} 9.0
sluice:kv_transfer_time_seconds_sum_other{direction="received"} 100.0
sluice:kv_transfer_fallbacks_total 2.0
"""
    assert metric_sum(text, "sluice:kv_transfer_time_seconds_sum", 'direction="received"') == 1.5
    assert metric_sum(text, "sluice:kv_transfer_time_seconds_sum") == 10.5
    assert metric_sum(text, "sluice:kv_transfer_fallbacks_total") == 2.0


def test_phase_rows_ratios_and_table():
    streams = [stream(0.0, 0.1, [0.1] * 20), stream(0.0, 0.1, [0.1] * 9 + [2.0] + [0.1] * 10)]
    longs = [Result(ok=True, start=0.5, ttft=4.0, prompt_tokens=2000, pd="prefill"),
             Result(ok=True, start=1.5, ttft=6.0, prompt_tokens=2000, pd="prefill"),
             Result(ok=False, start=2.0, error="HTTP 503")]
    transfer = {"pull_seconds": 1.0, "pulls": 2.0, "bytes": 90e6, "fallbacks": 0.0,
                "leg_failures": 0.0}
    base = phase_row("disaggregated-baseline", "disaggregated",
                     [stream(0.0, 0.1, [0.1] * 20)] * 2, [], 0.0, 5.0, {
                         k: 0.0 for k in transfer})
    loaded = phase_row("disaggregated", "disaggregated", streams, longs, 0.0, 5.0, transfer)
    agg = phase_row("aggregated", "aggregated", streams, longs[:1], 0.0, 5.0)
    assert loaded["long_sent"] == 3 and loaded["long_done"] == 2
    assert loaded["long_ttft_s"] == 5.0 and loaded["long_prompt_tokens"] == 2000
    assert loaded["pull_s"] == 0.5 and loaded["pull_mb"] == 45.0
    assert loaded["pull_share"] == pytest.approx(0.1)
    assert loaded["pd"] == {"prefill": 2, "none": 1} and loaded["stream_pd"] == {"short": 2}
    assert loaded["itl_p99_ms"] == pytest.approx(2000.0) and loaded["gaps"] == 40
    assert loaded["itl_max_ms"] == pytest.approx(2000.0) and loaded["stalls"] == 1
    assert base["stalls"] == 0 and base["itl_p999_ms"] == pytest.approx(100.0)
    assert base["pull_s"] is None and "pull_s" not in agg
    add_ratios([base, loaded, agg])
    assert base["p99_vs_baseline"] == 1.0
    assert loaded["p99_vs_baseline"] == pytest.approx(20.0)
    assert agg["p99_vs_baseline"] is None  # no aggregated baseline among these rows
    table = format_table([base, loaded, agg]).splitlines()
    assert len(table) == 5 and all(line.count("|") == 14 for line in table)
    assert "| disaggregated | 3 (2) |" in table[3] and "0.50 s, 45.0 MB" in table[3]
    assert "10.0%" in table[3] and "| – |" in table[4]


def test_long_prompts_are_seeded_and_distinct():
    a, b = long_prompts(0, 50, 3), long_prompts(0, 50, 3)
    assert a == b and len(set(a)) == 3 and all(len(p.split()) == 50 for p in a)
    assert long_prompts(1, 50, 1)[0] not in a


@pytest.mark.slow  # two whole stacks (2 engines each, picker, Envoy, Redis), one after the other
def test_through_stack_cli_runs_both_shapes(tiny_chat_model, tmp_path, capsys):
    from sluice.bench import pd_interference

    out = tmp_path / "pd.json"
    code = pd_interference.main([
        "--through-stack", "--model", str(tiny_chat_model), "--prompt-len", "300",
        "--streams", "2", "--stream-tokens", "24", "--rate", "2", "--phase-s", "2",
        "--warmup-s", "0.5", "--result-json", str(out), "--",
        "--dtype", "float32", "--num-kv-blocks", "512", "--block-size", "16",
        "--max-model-len", "1024", "--max-num-batched-tokens", "64"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    rows = {r["phase"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["aggregated-baseline", "aggregated", "disaggregated-baseline",
                          "disaggregated"]
    assert all(r["gaps"] > 0 and r["stream_errors"] == 0 for r in rows.values())
    agg = rows["aggregated"]
    assert agg["long_done"] == agg["long_sent"] >= 1 and agg["pd"] == {"none": agg["long_sent"]}
    dis = rows["disaggregated"]
    # every long prompt was prefilled on the prefill engine and pulled, with no fallback
    assert dis["long_done"] == dis["long_sent"] >= 1 and dis["pd"] == {"prefill": dis["long_sent"]}
    assert dis["pulls"] == dis["long_sent"] and dis["fallbacks"] == 0 and dis["pull_mb"] > 0
    assert set(dis["stream_pd"]) == {"short"}  # the streams' chats stay under the threshold
    assert rows["disaggregated-baseline"]["p99_vs_baseline"] == 1.0
    assert "| disaggregated |" in printed
