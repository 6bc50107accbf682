"""`sluice operator`: run the InferencePool operator (kopf) against the current cluster.

In a pod it logs in with its ServiceAccount; elsewhere with the kubeconfig. Two
replicas coordinate through kopf peering (`--peering`, a ClusterKopfPeering object
the chart installs) so only one acts at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random

from sluice.operator.config import OperatorConfig
from sluice.operator.render import RenderConfig
from sluice.operator.render_gie import DEFAULT_PICKER_PORT, FAILURE_MODES, GieConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RenderConfig()
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch this namespace (repeatable); default: all namespaces")
    parser.add_argument("--engine-image", default=os.environ.get("SLUICE_ENGINE_IMAGE",
                                                                 d.engine_image))
    parser.add_argument("--vllm-image", default=os.environ.get("SLUICE_VLLM_IMAGE",
                                                               d.vllm_image))
    parser.add_argument("--engine-api-key-secret", metavar="SECRET[:KEY]",
                        default=os.environ.get("SLUICE_ENGINE_API_KEY_SECRET"),
                        help="the Secret (in each pool's namespace) whose KEY (default 'key') "
                             "engines take as their API key ($VLLM_API_KEY)")
    parser.add_argument("--engine-api-key", default=os.environ.get("SLUICE_ENGINE_API_KEY"),
                        help="the engines' key itself, sent with the LoRA adapter loads "
                             "(Authorization: Bearer); also $SLUICE_ENGINE_API_KEY, as the "
                             "picker's")
    parser.add_argument("--kv-events-curve-secret", metavar="SECRET",
                        default=os.environ.get("SLUICE_KV_EVENTS_CURVE_SECRET"),
                        help="the Secret (in each pool's namespace) with the sluice engines' "
                             "CURVE keys for their KV-event sockets (python -m "
                             "sluice.zmq_curve_secrets); vLLM pools stay plain")
    parser.add_argument("--kv-transfer-curve-secret", metavar="SECRET",
                        default=os.environ.get("SLUICE_KV_TRANSFER_CURVE_SECRET"),
                        help="the Secret (in each pool's namespace) with the CURVE keys of "
                             "prefill/decode pools' KV-transfer sockets (python -m "
                             "sluice.zmq_curve_secrets --kv-transfer); each role mounts its "
                             "half; vLLM pools (NIXL) stay plain")
    parser.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL"),
                        help="the gateway's Redis, for the index finalizer "
                             "(env SLUICE_REDIS_URL; may hold a password)")
    parser.add_argument("--peering", default="sluice", help="kopf peering object name")
    parser.add_argument("--standalone", action="store_true",
                        help="no peering (a single replica only)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority (default: random, so replicas never tie)")
    parser.add_argument("--resync-interval", type=float, default=60.0)
    parser.add_argument("--autoscale-interval", type=float, default=15.0)
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="kopf liveness endpoint ('' to disable)")
    parser.add_argument("--gie-endpoint-picker", metavar="SERVICE",
                        default=os.environ.get("SLUICE_GIE_ENDPOINT_PICKER", ""),
                        help="GIE mode: also write, per pool, an inference.networking.k8s.io "
                             "InferencePool whose endpoint picker is this Service (in the "
                             "pool's namespace); empty: off (env SLUICE_GIE_ENDPOINT_PICKER)")
    parser.add_argument("--gie-endpoint-picker-port", type=int, default=DEFAULT_PICKER_PORT)
    parser.add_argument("--gie-failure-mode", choices=FAILURE_MODES, default="FailClose")
    parser.add_argument("--gie-namespace", default=None,
                        help="GIE mode: only pools of this namespace (where the picker is)")
    parser.add_argument("--gie-picker-template", metavar="DEPLOYMENT", default=None,
                        help="GIE mode: run a picker per pool (<pool>-epp), this picker "
                             "Deployment scoped to the pool (--pool-name); its GIE pool "
                             "names it")
    parser.add_argument("--verbose", "-v", action="store_true")


def gie_from_args(args: argparse.Namespace) -> GieConfig | None:
    if not args.gie_endpoint_picker:
        return None
    return GieConfig(picker_service=args.gie_endpoint_picker,
                     picker_port=args.gie_endpoint_picker_port,
                     failure_mode=args.gie_failure_mode, namespace=args.gie_namespace or None,
                     picker_template=args.gie_picker_template or None)


def _render_config(args: argparse.Namespace) -> RenderConfig:
    secret, _, key = (args.engine_api_key_secret or "").partition(":")
    return RenderConfig(engine_image=args.engine_image, vllm_image=args.vllm_image,
                        engine_key_secret=secret or None, engine_key_key=key or "key",
                        kv_events_curve_secret=args.kv_events_curve_secret or None,
                        kv_transfer_curve_secret=args.kv_transfer_curve_secret or None)


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    return OperatorConfig(
        render=_render_config(args),
        namespaces=tuple(args.namespace), peering_name=args.peering,
        standalone=args.standalone,
        priority=args.priority if args.priority is not None else random.randint(1, 2**31 - 1),
        resync_interval_s=args.resync_interval,
        autoscale_interval_s=args.autoscale_interval, redis_url=args.redis_url,
        liveness_endpoint=args.liveness or None, gie=gie_from_args(args),
        engine_api_key=args.engine_api_key or None,
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    from kubernetes_asyncio.config import ConfigException

    from sluice.operator import credentials
    from sluice.operator.runtime import run

    async def main_async() -> None:
        try:
            configuration = await credentials.load()
        except ConfigException as e:
            raise SystemExit(f"sluice operator: no ServiceAccount token and no usable "
                             f"kubeconfig ({e})") from None
        await run(config_from_args(args), configuration)

    asyncio.run(main_async())
    return 0
