"""`sluice up`: run Redis, N engines, the endpoint picker and Envoy on this machine.

`--engines N`: N aggregated engines. `--prefill N --decode M`: disaggregated prefill/decode
(`roles.py`): the picker sends each request to a decode engine and, for a long prompt,
names a prefill engine that prefills it first. The two shapes are mutually exclusive.

Every process's log lines carry its name; Ctrl-C (or SIGTERM) stops them all,
Envoy and the picker first. A process that exits on its own is started again,
with backoff (`supervisor.py`), while the others keep serving.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time

from sluice.gateway.routing.config import shipped_names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=None,
                   help="number of aggregated engine processes (default 2)")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="disaggregated: N prefill engines (kv_producer), with --decode; "
                        "instead of --engines")
    p.add_argument("--decode", type=int, default=0, metavar="M",
                   help="disaggregated: M decode engines (kv_consumer), with --prefill"),
    p.add_argument("--model", default="default", help="model for every engine")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--routing", choices=shipped_names(), default="kv_aware")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's (Envoy's) host")
    p.add_argument("--port", type=int, default=8000, help="the gateway's (Envoy's) port")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--engine-args", default="", help='extra engine flags, e.g. '
                   '"--kv-cache-memory 256MiB --max-num-seqs 64"')
    p.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"),
                   help="clients must send Authorization: Bearer KEY (default: open, as vLLM "
                        "without --api-key; the stack listens on loopback)")
    p.add_argument("--api-keys-dir", default=None,
                   help="a folder of client keys, one file each, read again when it changes")
    p.add_argument("--tls-cert", default=None,
                   help="HTTPS on the gateway: this PEM certificate (chain), with --tls-key; "
                        "a renewed file is served without a restart")
    p.add_argument("--tls-key", default=None, help="the certificate's PEM private key")
    p.add_argument("--gateway-args", default="", help="extra flags of the picker (sluice epp)")
    p.add_argument("--log-level", default="info")


def shape_error(engines: int | None, prefill: int, decode: int) -> str | None:
    """Why the engine counts make no stack, or None."""
    if (prefill or decode) and engines is not None:
        return ("--engines (aggregated engines) and --prefill/--decode (disaggregated "
                "prefill and decode engines) are mutually exclusive: give one or the other")
    if prefill or decode:
        if prefill < 1 or decode < 1:
            return (f"a disaggregated stack needs --prefill N and --decode M, both at least 1 "
                    f"(got --prefill {prefill} --decode {decode})")
        if prefill + decode > 64:
            return "at most 64 engines"
    elif engines is not None and not 1 <= engines <= 64:
        return f"--engines must be 1 to 64 (got {engines})"
    return None


def main(args: argparse.Namespace) -> int:
    from sluice.local.stack import LocalStack, StackConfig
    from sluice.local.supervisor import Supervisor

    if bool(args.tls_cert) != bool(args.tls_key):
        print("sluice up: --tls-cert and --tls-key go together", file=sys.stderr, flush=True)
        return 2
    problem = shape_error(args.engines, args.prefill, args.decode)
    if problem is not None:
        print(f"sluice up: {problem}", file=sys.stderr, flush=True)
        return 2
    cfg = StackConfig(engines=args.engines or 2, prefill=args.prefill, decode=args.decode,
                      model=args.model,
                      served_model_name=args.served_model_name, routing=args.routing,
                      host=args.host, port=args.port, redis_url=args.redis_url,
                      engine_args=tuple(shlex.split(args.engine_args)),
                      gateway_args=(*shlex.split(args.gateway_args),
                                    *(["--api-keys-dir", args.api_keys_dir]
                                      if args.api_keys_dir else [])),
                      api_key=args.api_key, tls_cert=args.tls_cert, tls_key=args.tls_key,
                      log_level=args.log_level)
    stack = LocalStack(cfg)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops everything like Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    code = 0
    try:
        stack.start()
        shape = (f"{cfg.prefill} prefill + {cfg.decode} decode engine(s)" if cfg.prefill
                 else f"{cfg.engines} engine(s)")
        print(f"sluice up: gateway on {stack.url}/v1 ({args.routing}), {shape}, "
              f"redis {stack.redis_url}; Ctrl-C stops all", flush=True)
        supervisor = Supervisor()
        while True:
            supervisor.check(stack.children())
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("sluice up: stopping", file=sys.stderr, flush=True)
    except (RuntimeError, TimeoutError, FileNotFoundError) as err:
        print(f"sluice up: {err}", file=sys.stderr, flush=True)
        code = 1
    finally:
        stack.stop()
    return code
