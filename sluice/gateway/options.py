"""The routing core's command-line options (`sluice epp` and the benchmarks use them)."""

from __future__ import annotations

import argparse
import logging
import os
import resource

from sluice.gateway.routing.config import shipped_names

log = logging.getLogger("sluice.gateway")


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    """Discovery, index, load and routing (`sluice epp`, the overhead benchmark)."""
    p.add_argument("--engine", action="append", default=[], metavar="SPEC",
                   help="static engine: URL[,events=tcp://h:5557][,replay=tcp://h:5558]"
                        "[,model=NAME][,pool=P][,role=prefill|decode|both] (repeatable; "
                        "prefill engines are never a destination, see --pd-threshold-tokens)")
    p.add_argument("--discovery", choices=("static", "kubernetes"), default="static")
    p.add_argument("--namespace", action="append", default=None, metavar="NS[,NS...]",
                   help="kubernetes: namespaces to watch, the operator's (repeatable, or a "
                        "comma list; '*' = every namespace); default: default")
    p.add_argument("--pool", default=None, help="kubernetes: only this InferencePool")
    p.add_argument("--pool-name", default=None,
                   help="kubernetes: serve this one InferencePool, as GIE's EPP does: only "
                        "the pods its selector names (replaces --namespace and --pool)")
    p.add_argument("--pool-namespace", default=os.environ.get("POD_NAMESPACE", "default"),
                   help="the --pool-name pool's namespace (default: $POD_NAMESPACE, else "
                        "default)")
    p.add_argument("--pool-group", default="inference.networking.k8s.io",
                   choices=("inference.networking.k8s.io", "sluice.dev"),
                   help="the --pool-name pool's API group: GIE's, or Sluice's own")
    p.add_argument("--redis-url", default=os.environ.get("SLUICE_REDIS_URL"),
                   help="shared index + load table (none: this replica's local view only)")
    p.add_argument("--routing", choices=shipped_names(), default="kv_aware",
                   help="a shipped routing configuration (sluice/gateway/routing/configs; "
                        "see docs/routing.md)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="an EndpointPickerConfig (llm-d's or GIE's file): plugins, "
                        "scheduling profiles, saturation detector, flow control; replaces "
                        "--routing")
    p.add_argument("--tokenizer", action="append", default=[], metavar="[MODEL=]PATH",
                   help="tokenizer + chat template source (HF folder or .gguf), repeatable")
    p.add_argument("--index-reads", choices=("local", "redis"), default="local",
                   help="where kv_aware lookups read the index: this replica's view (fed by "
                        "every engine's events, with the other replicas' routing decisions "
                        "mirrored from Redis: no Redis round trip per request) or redis "
                        "(one round trip per request)")
    p.add_argument("--speculative-flush-ms", type=float, default=10.0,
                   help="routing decisions of this long are written to Redis in one call "
                        "(other replicas see them that much later; this one at once)")
    p.add_argument("--block-size", type=int, default=16,
                   help="block size assumed until an engine reports its own")
    p.add_argument("--max-failures", type=int, default=3,
                   help="connection failures in a row that eject a pod until a probe passes")
    p.add_argument("--max-ejection-fraction", type=float, default=0.5,
                   help="at most this fraction of the pods (at least one) ejected at once")
    p.add_argument("--probe-interval", type=float, default=1.0,
                   help="seconds between /health probes of every pod (two failed in a row "
                        "take a pod out, one passed brings it back)")
    p.add_argument("--scrape-interval", type=float, default=0.15)
    p.add_argument("--load-ttl-ms", type=int, default=1000)
    p.add_argument("--forget-pod-after", type=float, default=30.0,
                   help="seconds a removed (e.g. not Ready) pod's index entries are kept")
    p.add_argument("--kv-events-curve-dir", default=None,
                   help="ZMQ CURVE keys (python -m sluice.zmq_curve init DIR) for the engines' "
                        "KV-event sockets; without it they are plain (vLLM's)")
    p.add_argument("--engine-api-key", default=os.environ.get("SLUICE_ENGINE_API_KEY"),
                   help="the engines' own key (their --api-key / $VLLM_API_KEY), sent to them "
                        "with every request; also $SLUICE_ENGINE_API_KEY")
    p.add_argument("--log-level", default="info")


def routing_parts(args: argparse.Namespace):
    """(CoreConfig, Discovery, PromptTokenizer) for `add_routing_arguments`' flags.
    SystemExit on a routing configuration that does not load, naming what is wrong."""
    from sluice.gateway.core import CoreConfig
    from sluice.gateway.discovery.static import StaticDiscovery, parse_engine_spec
    from sluice.gateway.prompt.tokenize import PromptTokenizer

    name, doc = routing_document(args)
    cfg = CoreConfig(routing=name, routing_document=doc, default_block_size=args.block_size,
                     redis_url=args.redis_url,
                     scrape_interval_s=args.scrape_interval, load_ttl_ms=args.load_ttl_ms,
                     max_failures=args.max_failures, probe_interval_s=args.probe_interval,
                     max_ejection_fraction=args.max_ejection_fraction,
                     speculative_flush_ms=args.speculative_flush_ms,
                     index_reads=args.index_reads, forget_pod_after_s=args.forget_pod_after,
                     engine_api_key=args.engine_api_key,
                     kv_events_curve_dir=args.kv_events_curve_dir)
    if args.discovery == "kubernetes":
        from sluice.gateway.discovery.kubernetes import KubernetesDiscovery, parse_namespaces
        from sluice.gateway.discovery.pool_scope import PoolRef
        ref = (PoolRef(args.pool_name, args.pool_namespace, args.pool_group)
               if args.pool_name else None)
        discovery = KubernetesDiscovery(parse_namespaces(args.namespace or ["default"]),
                                        args.pool, pool_ref=ref)
    else:
        if args.pool_name:
            raise SystemExit("--pool-name needs --discovery kubernetes")
        if not args.engine:
            raise SystemExit("give at least one --engine (or --discovery kubernetes)")
        discovery = StaticDiscovery([parse_engine_spec(s) for s in args.engine])
    return cfg, discovery, PromptTokenizer.from_paths(args.tokenizer)


def routing_document(args: argparse.Namespace) -> tuple[str, dict]:
    """(The plan's name, its EndpointPickerConfig): --config's file, else the shipped
    --routing one; --pd-threshold-tokens, where given, sets its prefix-based-pd-decider's
    nonCachedTokens."""
    from sluice.gateway.routing.config import read_document, set_parameters
    from sluice.gateway.routing.registry import PluginError

    try:
        if args.config:
            name, doc = os.path.basename(args.config).rsplit(".", 1)[0], read_document(
                args.config)
        else:
            name, doc = args.routing, read_document(shipped=args.routing)
        if getattr(args, "pd_threshold_tokens", None) is not None:
            doc = set_parameters(doc, "prefix-based-pd-decider",
                                 nonCachedTokens=args.pd_threshold_tokens)
    except (OSError, PluginError) as err:
        raise SystemExit(f"routing configuration: {err}") from err
    return name, doc


def raise_open_files_limit() -> None:
    """Soft limit of open files up to the hard one (as vLLM's server does): the
    picker holds ~6 descriptors per pod (its ZMQ sockets and their connections)
    besides its gRPC streams and scrape connections; 1024 is a common default."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20  # (the kernel's nr_open)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as err:
            log.warning("open files limit stays %d: %s", soft, err)
