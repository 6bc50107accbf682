"""Assemble the operator (client, reconciler, autoscaler, purger, kopf registry) and run it.

`run()` is what `sluice operator` executes; tests call it with the emulator's
connection, a stop flag and fakes for the metrics sampler and the index purger.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import httpx
import kopf

from sluice.operator import cleanup, handlers, kube, metrics, redis_load
from sluice.operator.autoscaler import Autoscaler, Sampler
from sluice.operator.config import OperatorConfig
from sluice.operator.reconciler import EventSink, Reconciler


def build_runtime(config: OperatorConfig, connection: kopf.ConnectionInfo, *,
                  purge: cleanup.IndexPurger | None = None, sampler: Sampler | None = None,
                  events: EventSink = handlers.post_event) -> handlers.Runtime:
    client = kube.KubeClient.from_connection(connection)
    if sampler is None:
        http = httpx.AsyncClient()
        sampler = functools.partial(_sample, http, config.metrics_timeout_s)
        if config.redis_url:  # engines unreachable from here: the gateways' load table
            sampler = redis_load.first_of(sampler, redis_load.redis_sampler(config.redis_url))
    if purge is None:
        purge = cleanup.redis_purger(config.redis_url) if config.redis_url else cleanup.no_index
    return handlers.Runtime(
        config=config, connection=connection, client=client,
        reconciler=Reconciler(client, config.render, events, gie=config.gie),
        autoscaler=Autoscaler(client, sampler, events), purge=purge)


async def _sample(http: httpx.AsyncClient, timeout: float, endpoints: list[dict[str, Any]],
                  role: str) -> Any:
    return await metrics.sample_pool(http, endpoints, role, timeout)


async def run(config: OperatorConfig, connection: kopf.ConnectionInfo, *,
              runtime: handlers.Runtime | None = None,
              stop_flag: asyncio.Event | None = None,
              ready_flag: asyncio.Event | None = None,
              settings: kopf.OperatorSettings | None = None) -> None:
    """Run until `stop_flag` (or a signal). `settings`: kopf tunables beyond `config`."""
    rt = runtime or build_runtime(config, connection)
    registry = handlers.register(kopf.OperatorRegistry(), rt)
    settings = settings or kopf.OperatorSettings()
    handlers.configure(settings, config)
    try:
        await kopf.operator(
            registry=registry, settings=settings, standalone=config.standalone,
            peering_name=None if config.standalone else config.peering_name,
            priority=config.priority,
            clusterwide=config.clusterwide,
            namespaces=list(config.namespaces), liveness_endpoint=config.liveness_endpoint,
            stop_flag=stop_flag, ready_flag=ready_flag)
    finally:
        await rt.client.close()
