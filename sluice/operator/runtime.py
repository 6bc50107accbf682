"""Assemble the operator (client, reconciler, autoscaler, purger, retrier, periodic loop,
kopf registry) and run it.

`run()` is what `sluice operator` executes; tests call it with a configuration for a
ServiceAccount's token on a real API server, a stop flag and fakes for the metrics
sampler and the index purger.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import socket
from typing import Any

import httpx
import kopf
from kubernetes_asyncio import client as k8s

from sluice.operator import cleanup, handlers, kube, metrics, redis_load
from sluice.operator.autoscaler import Autoscaler, Sampler
from sluice.operator.config import OperatorConfig
from sluice.operator.events import EventPoster
from sluice.operator.lora import LoraSyncer
from sluice.operator.reconciler import EventSink, Reconciler
from sluice.operator.retry import Retrier
from sluice.operator.ticker import Ticker


def build_runtime(config: OperatorConfig, configuration: k8s.Configuration, *,
                  purge: cleanup.IndexPurger | None = None, sampler: Sampler | None = None,
                  events: EventSink | None = None,
                  transport: httpx.AsyncBaseTransport | None = None) -> handlers.Runtime:
    """`configuration`: the cluster and identity (`credentials.load`). `purge` None: the
    Redis purger when `config.redis_url` is set, else no index cleanup (and no finalizer).
    `transport`: how the engines are reached (tests: engines on loopback)."""
    client = kube.KubeClient.from_configuration(configuration)
    http = httpx.AsyncClient(transport=transport)  # to the engines: metrics and LoRA loads
    if sampler is None:
        sampler = functools.partial(_sample, http, config.metrics_timeout_s)
        if config.redis_url:  # engines unreachable from here: the gateways' load table
            sampler = redis_load.first_of(sampler, redis_load.redis_sampler(config.redis_url))
    if purge is None and config.redis_url:
        purge = cleanup.redis_purger(config.redis_url)
    events = events or EventPoster(client)
    reconciler = Reconciler(client, config.render, events, gie=config.gie,
                            loras=LoraSyncer(http, config.engine_api_key))
    autoscaler = Autoscaler(client, sampler, events)
    return handlers.Runtime(
        config=config, configuration=configuration, client=client, events=events, reconciler=reconciler,
        autoscaler=autoscaler, purge=purge, retrier=Retrier(config.backoff),
        ticker=Ticker(client, config, reconciler, autoscaler), http=http)


async def _sample(http: httpx.AsyncClient, timeout: float, endpoints: list[dict[str, Any]],
                  role: str) -> Any:
    return await metrics.sample_pool(http, endpoints, role, timeout)


def identity() -> str:
    """This operator's name among its peers: the pod's name (the hostname), the process
    and a random part, one per `run`. Not kopf's default, which starts with the user's
    login name: a pod run under an arbitrary UID (OpenShift's restricted SCC) has none,
    and kopf would fail at start."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


async def run(config: OperatorConfig, configuration: k8s.Configuration, *,
              runtime: handlers.Runtime | None = None,
              stop_flag: asyncio.Event | None = None,
              ready_flag: asyncio.Event | None = None,
              settings: kopf.OperatorSettings | None = None) -> None:
    """Run until `stop_flag` (or a signal). `settings`: kopf tunables beyond `config`."""
    rt = runtime or build_runtime(config, configuration)
    registry = handlers.register(kopf.OperatorRegistry(), rt)
    settings = settings or kopf.OperatorSettings()
    handlers.configure(settings, config)
    ticker = asyncio.create_task(rt.ticker.run(), name="sluice periodic work")
    try:
        await kopf.operator(
            registry=registry, settings=settings, standalone=config.standalone,
            peering_name=None if config.standalone else config.peering_name,
            priority=config.priority,
            clusterwide=config.clusterwide,
            namespaces=list(config.namespaces), liveness_endpoint=config.liveness_endpoint,
            identity=identity(),
            stop_flag=stop_flag, ready_flag=ready_flag)
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        await rt.retrier.close()
        if isinstance(rt.events, EventPoster):
            await rt.events.flush()
        await rt.client.close()
        if rt.http is not None:
            await rt.http.aclose()
