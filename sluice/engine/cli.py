"""`sluice engine`: serve one model over the OpenAI API."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from sluice.engine.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_size,
)

log = logging.getLogger("sluice.engine")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="HF folder, .gguf file, or 'default' (SmolLM2-135M-Instruct); with "
                        "--load-format dummy: a config.json or a named shape")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "cpu", "torch", "triton"],
                   help="auto: Triton on CUDA; on CPU the compiled paged attention kernel "
                        "(cpu: required), else torch (plain PyTorch, the reference)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV-cache budget on CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's type: auto (the model's dtype) or fp8 (= fp8_e4m3: "
                        "one byte per value, twice the blocks in the same memory; stored as "
                        "x / scale, the checkpoint's k_scale/v_scale or 1, as vLLM's flag)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the KV budget")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="at most this many prompt tokens of one request per step (0: no "
                        "cap), so short prompts are not queued behind a long prefill")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="fcfs: arrival order; priority: by each request's `priority` (lower "
                        "first; from the gateway, its objective's priority), preempting lower "
                        "priorities (vLLM's flag)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="bounded waiting queue; beyond it requests get 429")
    p.add_argument("--max-request-body-bytes", type=_positive_int, default=16 * 1024 * 1024,
                   help="largest HTTP request body accepted, in bytes (default 16 MiB); a "
                        "larger one gets 413 before it is read or parsed (Sluice's own flag: "
                        "vLLM has none)")
    p.add_argument("--max-prompts-per-request", type=_positive_int, default=64,
                   help="most prompts one /v1/completions request may batch (default 64); "
                        "more get 400. n x prompts must also fit the waiting queue's free "
                        "room (--max-waiting-requests), else 429 (Sluice's own flag)")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="ZMQ PUB endpoint for KV-cache events, e.g. tcp://*:5557")
    p.add_argument("--kv-events-replay-endpoint", default=None,
                   help="ZMQ ROUTER endpoint for event replay, e.g. tcp://*:5558")
    p.add_argument("--kv-events-curve-dir", default=None,
                   help="ZMQ CURVE keys for the KV-event sockets (python -m sluice.zmq_curve "
                        "init DIR): encrypted, and only the pickers' key may read them")
    p.add_argument("--kv-events-topic", default=None,
                   help="topic (default kv@<host>:<port>@<served-model-name>)")
    p.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: 'auto' (the model folder's "
                        "generation_config.json), 'vllm' (none), or a folder")
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for torch in the engine core, per tensor-parallel rank "
                        "(default: the physical "
                        "cores, at most the CPUs this process may use (affinity and cgroup "
                        "quota) minus one left to the API process; oversubscribed threads "
                        "stall)")
    p.add_argument("--quantization", "-q", default=None, choices=["gguf", "fp8", "gptq", "awq"],
                   help="gguf: keep a GGUF file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K "
                        "blocks and multiply them as stored (other types are dequantized to "
                        "--dtype); fp8: e4m3 weights, quantized at load from a bf16 folder "
                        "(a folder whose config declares fp8 is read as such without the "
                        "flag); gptq, awq: a folder of GPTQ (4-bit, desc_act false) or AWQ "
                        "(4-bit gemm) weights, read as such with or without the flag; "
                        "default: the checkpoint's weights in --dtype")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks, one process each: GPUs 0 .. "
                        "N-1 on CUDA (NCCL), core groups of --num-threads each on the CPU "
                        "(gloo); the heads, the MLP and the vocabulary divide by it")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="clients send Authorization: Bearer KEY (also $VLLM_API_KEY, as vLLM); "
                        "without it the OpenAI API is open and the admin endpoints and API "
                        "docs are not served")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="parse tool calls from the model's output for tool_choice auto "
                        "(hermes: <tool_call> JSON, Qwen2.5/Qwen3; llama3_json: Llama 3.x)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag, accepted for the same command lines: auto tool choice "
                        "is on whenever --tool-call-parser is given")
    p.add_argument("--allow-unknown-fields", action="store_true",
                   help="ignore request fields this server does not implement (logged once "
                        "per field name) instead of answering 400")
    p.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None,
                   help="disaggregated prefill/decode, vLLM's JSON: e.g. '{\"kv_connector\": "
                        "\"SluiceConnector\", \"kv_role\": \"kv_both\", \"kv_port\": 14579}' "
                        "(sluice/engine/kv_transfer/config.py lists the keys)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help="speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}', "
                        "'{\"method\": \"draft_model\", \"model\": PATH, ...}' or "
                        "'{\"method\": \"early_exit\", \"num_layers\": L, ...}' "
                        "(sluice/engine/spec_decode/config.py lists the keys)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) on the base model, several in "
                        "one batch (vLLM's flags below)")
    p.add_argument("--lora-modules", action="append", type=_lora_module, default=[],
                   metavar="NAME=PATH", help="an adapter to serve from startup, repeatable; "
                   "also vLLM's JSON form '{\"name\": ..., \"path\": ...}'")
    p.add_argument("--max-loras", type=_positive_int, default=1,
                   help="distinct adapters in one batch")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    p.add_argument("--max-cpu-loras", type=_positive_int, default=None,
                   help="adapters kept loaded in memory, least recently used dropped "
                        "(default: --max-loras); others are read again when requested")
    p.add_argument("--log-level", default="info")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _lora_module(text: str):
    from sluice.engine.lora.config import LoRAModulePath

    try:
        return LoRAModulePath.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_config(args: argparse.Namespace):
    from sluice.engine.lora.config import LoRAConfig

    if not args.enable_lora:
        if args.lora_modules:
            raise SystemExit("--lora-modules needs --enable-lora (vLLM's rule)")
        return None
    try:
        return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras,
                          tuple(args.lora_modules))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _kv_transfer_config(text: str):
    from sluice.engine.kv_transfer.config import KVTransferConfig

    try:
        return KVTransferConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _speculative_config(text: str):
    from sluice.engine.spec_decode.config import SpeculativeConfig

    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from sluice.default_model import DEFAULT_SERVED_MODEL_NAME, resolve_model

    model = args.model
    if args.load_format != "dummy":
        model = resolve_model(None if model == "default" else model)
    name = args.served_model_name or (
        DEFAULT_SERVED_MODEL_NAME if args.model == "default" else os.path.basename(
            model.rstrip("/")).removesuffix(".gguf"))
    return EngineConfig(
        model=model, served_model_name=name, load_format=args.load_format, dtype=args.dtype,
        device=args.device, seed=args.seed, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cache=CacheConfig(block_size=args.block_size,
                          kv_cache_memory=parse_size(args.kv_cache_memory),
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.prefix_caching,
                          num_blocks=args.num_kv_blocks, cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  long_prefill_token_threshold=(
                                      args.long_prefill_token_threshold),
                                  max_model_len=args.max_model_len,
                                  max_waiting_requests=args.max_waiting_requests,
                                  policy=args.scheduling_policy),
        kv_transfer=args.kv_transfer_config,
        speculative=getattr(args, "speculative_config", None),
        lora=_lora_config(args),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        quantization=args.quantization,
    )


class _DropProbes(logging.Filter):
    """Keep scrapes and probes (/metrics every ~100 ms from each gateway) out of the access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and args[2] in ("/metrics", "/health"))


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from sluice.engine.core.client import EngineCoreClient
    from sluice.engine.core.process import CoreSpec, KVEventsSpec
    from sluice.engine.server.api import build_app
    from sluice.engine.server.generation_config import load_sampling_defaults
    from sluice.tokenizer import Tokenizer

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.access").addFilter(_DropProbes())
    config = engine_config(args)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (vLLM's rule)")
    import torch

    from sluice.cpus import engine_threads, usable_cpus

    # torch's own default counts the machine's physical cores, blind to the affinity
    # mask and a cgroup quota (a pod's CPU limit): bounded by them
    num_threads = args.num_threads or min(torch.get_num_threads(), engine_threads(
        usable_cpus(), config.parallel.tensor_parallel_size))
    defaults = load_sampling_defaults(args.generation_config, config.model)
    if defaults:
        log.info("default sampling parameters from generation_config.json: %s", defaults)
    tok_path = args.tokenizer or (None if args.load_format == "dummy" else config.model)
    tokenizer = Tokenizer.from_path(tok_path) if tok_path else None
    kv_events = None
    if args.kv_events_endpoint:
        topic = args.kv_events_topic or (
            f"kv@{args.host if args.host not in ('0.0.0.0', '::') else socket.gethostname()}"
            f":{args.port}@{config.served_model_name}")
        kv_events = KVEventsSpec(args.kv_events_endpoint, args.kv_events_replay_endpoint, topic,
                                 args.kv_events_curve_dir)
    spec = CoreSpec(config, tok_path, num_threads, kv_events, "", "", args.log_level)
    servers: list[uvicorn.Server] = []
    # A dead core leaves nothing to serve: stop uvicorn, and exit 1 for the supervisor.
    engine = EngineCoreClient(spec, on_dead=lambda: [setattr(s, "should_exit", True)
                                                     for s in servers])
    app = build_app(engine, tokenizer, config.served_model_name, defaults,
                    max_request_body_bytes=args.max_request_body_bytes,
                    max_prompts_per_request=args.max_prompts_per_request,
                    api_key=args.api_key, tool_call_parser=args.tool_call_parser,
                    allow_unknown_fields=args.allow_unknown_fields)
    log.info("serving %s on http://%s:%d (%s)", config.served_model_name, args.host, args.port,
             "API key required" if args.api_key else "no API key: open; admin endpoints off")
    try:
        servers.append(uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level.lower(),
            timeout_graceful_shutdown=5)))
        servers[0].run()
    finally:
        engine.shutdown()
    return 1 if engine.error is not None else 0
