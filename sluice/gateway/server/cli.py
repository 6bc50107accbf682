"""`sluice epp`: the endpoint picker (GIE's ext_proc protocol) for Envoy."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal

from sluice.gateway.options import add_routing_arguments, raise_open_files_limit, routing_parts
from sluice.gateway.server.picker import PickerConfig
from sluice.gateway.server.rate_limit import Limits

log = logging.getLogger("sluice.gateway.epp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc and gRPC health")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus (0: none)")
    p.add_argument("--grpc-health-port", type=int, default=0,
                   help="gRPC health alone, plaintext, for kubelet probes (GIE: 9003; 0: none)")
    p.add_argument("--secure-serving", action=argparse.BooleanOptionalAction, default=False,
                   help="TLS on --grpc-port (GIE's flag): the pair in --cert-path, else a "
                        "self-signed certificate made at start")
    p.add_argument("--cert-path", default=None,
                   help="folder with tls.crt and tls.key, read again when they change")
    p.add_argument("--client-ca-file", default=None,
                   help="mutual TLS: clients must present a certificate this CA signed")
    d = PickerConfig()
    p.add_argument("--max-fallbacks", type=int, default=d.max_fallbacks,
                   help="endpoints named after the chosen one, for the data plane's retries")
    p.add_argument("--shed-waiting", type=int, default=d.shed_waiting,
                   help="429 when every eligible engine has this many requests waiting")
    p.add_argument("--pd-threshold-tokens", type=int, default=None,
                   help="pools with prefill pods: a prompt of at least this many tokens not "
                        "cached on the chosen decode pod is prefilled on a prefill pod "
                        "(x-prefiller-host-port); shorter ones on the decode pod (0: never). "
                        "Sets the prefix-based-pd-decider's nonCachedTokens (the shipped "
                        "configurations': 100)")
    p.add_argument("--objective", action="append", default=[],
                   metavar="NAME=PRIORITY[,models=A|B][,keys=K1|K2]",
                   help="an InferenceObjective: requests naming NAME in "
                        "x-llm-d-inference-objective (or x-gateway-inference-objective), "
                        "or for these models, or with these API keys (by name), get "
                        "PRIORITY (higher first; < 0: sheddable) in flow control "
                        "(repeatable; docs/routing.md)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="the largest request body a Gateway may stream to the picker "
                        "(FULL_DUPLEX_STREAMED); 413 beyond")
    p.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"),
                   help="a client key (Authorization: Bearer KEY), named 'default'; also "
                        "$SLUICE_API_KEY. With no key at all the gateway is open")
    p.add_argument("--rate-limit-rpm", type=int, default=0,
                   help="requests per minute per API key, shared by every replica through "
                        "Redis (0: none); beyond it 429 with Retry-After")
    p.add_argument("--rate-limit-tpm", type=int, default=0,
                   help="tokens per minute per API key: prompt + max_tokens (0: none)")
    p.add_argument("--api-keys-dir", default=None,
                   help="a folder of keys, one file each (its name is the key's name), "
                        "e.g. a mounted Secret; read again when it changes")
    add_routing_arguments(p)


def default_tokenizer(core) -> None:
    """A routing plan that reads the prompt with no `--tokenizer` given: the bundled
    default model's tokenizer for that model (when installed); any other model's
    prompts through a pod's `/tokenize` (said at start-up)."""
    if not core.plan.uses_prompt or core.tokenizer.by_model or core.tokenizer.default:
        return
    from sluice.default_model import (
        DEFAULT_SERVED_MODEL_NAME,
        ModelNotFoundError,
        resolve_default_model,
    )
    from sluice.gateway.prompt.tokenize import PromptTokenizer

    try:
        path = resolve_default_model()
    except ModelNotFoundError:
        path = None
    else:
        core.tokenizer = PromptTokenizer.from_paths([f"{DEFAULT_SERVED_MODEL_NAME}={path}"])
    log.warning("no --tokenizer: routing %s tokenizes %s prompts through a pod's "
                "/tokenize (one more round trip per request)", core.plan.name,
                "every model's" if path is None else f"all but {DEFAULT_SERVED_MODEL_NAME}'s")


def serving_tls(args: argparse.Namespace):
    """--secure-serving's ServingTls; None: plaintext (SystemExit: TLS files without it)."""
    from sluice.gateway.server.serving_tls import ServingTls

    if not args.secure_serving:
        if args.cert_path or args.client_ca_file:
            raise SystemExit("--cert-path and --client-ca-file need --secure-serving")
        return None
    return ServingTls(args.cert_path, args.client_ca_file)


async def _serve(args: argparse.Namespace) -> None:
    from sluice.gateway.core import RoutingCore
    from sluice.gateway.flow.objectives import Objectives
    from sluice.gateway.routing.registry import PluginError
    from sluice.gateway.server.api_keys import ApiKeys
    from sluice.gateway.server.grpc_server import PickerServer

    try:
        core = RoutingCore(*routing_parts(args))
    except PluginError as err:
        raise SystemExit(f"routing configuration: {err}") from err
    default_tokenizer(core)
    limits = Limits(args.rate_limit_rpm, args.rate_limit_tpm)
    try:
        objectives = Objectives.from_specs(args.objective)
    except ValueError as err:
        raise SystemExit(f"--objective: {err}") from err
    server = PickerServer(core, PickerConfig(args.max_fallbacks, args.shed_waiting, limits,
                                             objectives, args.max_body_bytes),
                          args.host, args.grpc_port, args.metrics_port,
                          ApiKeys(args.api_key, args.api_keys_dir), serving_tls(args),
                          args.grpc_health_port)
    await server.start()
    gc.freeze()  # start-up's objects out of the collector's reach (p99: docs/benchmarks.md)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


# gRPC's EventEngine listener reads each connection on a thread pool of its own, which
# hands every message to the poller thread of grpc.aio's completion queue: one thread wake
# more per message, ~10 per request. iomgr's listener reads in that poller: ~10 % less picker
# CPU per request and a lower p99 (docs/benchmarks.md). Set before gRPC starts; an
# operator's own GRPC_EXPERIMENTS wins.
LISTENER_EXPERIMENT = "-event_engine_listener"


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRPC_EXPERIMENTS", LISTENER_EXPERIMENT)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_files_limit()
    run_loop(_serve(args))
    return 0


def run_loop(main_coro) -> None:
    """uvloop when installed: each gRPC completion reaches the handler through the
    loop (grpc.aio's poller thread wakes it), and uvloop's wake-up and callback
    dispatch cost ~20 % less per ext_proc message (docs/benchmarks.md)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - the gateway image installs it
        asyncio.run(main_coro)
        return
    uvloop.run(main_coro)
