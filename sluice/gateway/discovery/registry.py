"""The engine pods the gateway knows, by model (= pool), and what follows from
a change: event feed subscriptions, Redis pod meta, health and load cleanup.

Endpoints whose model is not given are asked for it (`GET /v1/models`, retried
each `probe_interval_s` while the endpoint exists); the models listed with a
`parent` are LoRA adapters (vLLM's `/v1/models`). Every active pod's list is
read again each `refresh_models()` call (every `models_refresh_s`, 10 s):
adapters loaded or unloaded at run time, also on endpoints configured with
their model (which is then the pod's base model, whatever the engine calls it)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from sluice.gateway.discovery.health import HealthTracker
from sluice.gateway.discovery.pod_client import POD_ERRORS, PodClient
from sluice.gateway.discovery.static import Endpoint
from sluice.gateway.events.feed import EventFeeder, EventSource
from sluice.gateway.load.table import LoadTable

log = logging.getLogger("sluice.gateway.discovery.registry")


class PodRegistry:
    def __init__(self, feeder: EventFeeder | None, redis_index: Any, loads: LoadTable,
                 health: HealthTracker, http: PodClient,
                 probe_interval_s: float = 1.0, forget_after_s: float = 30.0) -> None:
        self.feeder = feeder
        self.redis = redis_index
        self.loads = loads
        self.health = health
        self.http = http
        self.probe_interval_s = probe_interval_s
        self._endpoints: dict[str, Endpoint] = {}   # every discovered pod
        self._models: dict[str, list[str]] = {}     # pod -> its served models (active pods)
        self._adapters: dict[str, frozenset[str]] = {}  # pod -> those of them LoRA adapters
        self._pending: dict[str, asyncio.Task] = {}
        self._seen: set[str] = set()  # every model an engine has served (few)
        self.on_remove: list[Callable[[str], None]] = []
        self.on_update: list[Callable[[list[Endpoint]], None]] = []  # all, after a change
        # A removed pod's KV-event subscription and index entries are kept for
        # `forget_after_s`: a pod that was only briefly not Ready comes back with
        # its cache (and entries) intact instead of being purged from Redis for
        # every gateway replica and replayed from 0. It is not routed to meanwhile.
        self.forget_after_s = forget_after_s
        self._subscribed: dict[str, EventSource] = {}
        self._forget_later: dict[str, asyncio.TimerHandle] = {}

    # -- queries ---------------------------------------------------------------------------
    def pods_for(self, model: str) -> list[str]:
        return [p for p, models in self._models.items() if model in models]

    def key_model(self, pod: str, model: str) -> str | None:
        """The name the pod's KV events key a request for `model` with: the adapter's
        own name for one of its LoRA adapters (its events carry it), else its
        base model's first served name (an alias hashes alike)."""
        adapters = self._adapters.get(pod, frozenset())
        if model in adapters:
            return model
        return _base_model(self._models.get(pod, []), adapters)

    def serves(self, model: str) -> bool:
        return any(model in models for models in self._models.values())

    def models(self) -> list[str]:
        return sorted({m for models in self._models.values() for m in models})

    def may_serve(self, model: str) -> bool:
        """Whether `model` may become servable again: an engine served it before or an
        endpoint is configured with it (a name never seen stays a 404)."""
        return model in self._seen or any(e.model == model for e in self._endpoints.values())

    def url_of(self, pod: str) -> str | None:
        ep = self._endpoints.get(pod)
        return None if ep is None else ep.url

    def role_of(self, pod: str) -> str | None:
        """The pod's role (`static.parse_role`); None: none given, or an unknown pod."""
        ep = self._endpoints.get(pod)
        return None if ep is None else ep.role

    def active(self) -> dict[str, str]:
        """{pod: base URL} of pods with a known model (scraped for load)."""
        return {p: self._endpoints[p].url for p in self._models}

    def block_size_of(self, pod: str) -> int | None:
        m = self.loads.metrics(pod)
        return None if m is None else m.block_size

    # -- changes ---------------------------------------------------------------------------
    def update(self, endpoints: list[Endpoint]) -> None:
        new = {e.pod: e for e in endpoints}
        for pod in list(self._endpoints):
            if pod not in new or new[pod] != self._endpoints[pod]:
                self._remove(pod)
        for pod, ep in new.items():
            if pod not in self._endpoints:
                self._endpoints[pod] = ep
                if ep.model is not None:
                    self._activate(ep, [ep.model])
                else:
                    self._pending[pod] = asyncio.get_running_loop().create_task(
                        self._learn_models(ep))
        for callback in self.on_update:
            callback(list(self._endpoints.values()))

    def _remove(self, pod: str) -> None:
        log.info("engine %s removed", pod)
        self._endpoints.pop(pod, None)
        self._models.pop(pod, None)
        self._adapters.pop(pod, None)
        task = self._pending.pop(pod, None)
        if task is not None:
            task.cancel()
        if pod in self._subscribed and pod not in self._forget_later:
            self._forget_later[pod] = asyncio.get_running_loop().call_later(
                self.forget_after_s, self._forget_index, pod)
        self.loads.drop(pod)
        self.health.forget(pod)
        for callback in self.on_remove:
            callback(pod)

    def _activate(self, ep: Endpoint, models: list[str],
                  adapters: frozenset[str] = frozenset()) -> None:
        log.info("engine %s serves %s (pool %s/%s, events %s)", ep.pod, ",".join(models),
                 ep.namespace, ep.pool, ep.events or "none")
        self._models[ep.pod] = models
        self._adapters[ep.pod] = adapters
        self._seen.update(models)
        base = _base_model(models, adapters)
        source = (EventSource(ep.pod, base, ep.events, ep.replay, ep.events_curve)
                  if ep.events else None)
        pending = self._forget_later.pop(ep.pod, None)
        if pending is not None:  # back within the grace period
            pending.cancel()
        if self._subscribed.get(ep.pod) != source:
            if ep.pod in self._subscribed and source is None:  # no events any more
                self._forget_index(ep.pod, gone=False)
            if self.feeder is not None and source is not None:
                # another event endpoint: `move` keeps the pod's position, and its
                # entries stay unless its batches show another engine behind it
                (self.feeder.move if ep.pod in self._subscribed else self.feeder.add)(source)
                self._subscribed[ep.pod] = source
        if self.redis is not None:
            try:
                self.redis.register_pod(ep.pod, ep.namespace, ep.pool, base)
            except Exception as err:  # noqa: BLE001 -- Redis down: meta is best effort
                log.warning("could not register %s in redis: %s", ep.pod, err)

    def register_all(self) -> None:
        """Write every known pod's registration to Redis again (after Redis lost its
        data). Thread-safe: called from the event feeder's thread."""
        if self.redis is None:
            return
        for pod, models in list(self._models.items()):
            ep = self._endpoints.get(pod)
            if ep is not None:
                try:
                    self.redis.register_pod(pod, ep.namespace, ep.pool, _base_model(
                        models, self._adapters.get(pod, frozenset())))
                except Exception as err:  # noqa: BLE001 -- best effort, as at activation
                    log.warning("could not register %s in redis: %s", pod, err)

    def _forget_index(self, pod: str, gone: bool = True) -> None:
        """Unsubscribe from the pod's events and drop its index entries everywhere
        (with its registration when it is `gone`)."""
        handle = self._forget_later.pop(pod, None)
        if handle is not None:
            handle.cancel()
        if self._subscribed.pop(pod, None) is not None and self.feeder is not None:
            self.feeder.remove(pod, gone)

    def close(self) -> None:
        for handle in self._forget_later.values():
            handle.cancel()
        self._forget_later.clear()

    async def _learn_models(self, ep: Endpoint) -> None:
        while (served := await self._served(ep)) is None:
            await asyncio.sleep(self.probe_interval_s)
        self._pending.pop(ep.pod, None)
        self._activate(ep, *served)

    async def refresh_models(self) -> None:
        """Read every active pod's `/v1/models` again; activate anew those whose
        models changed (a pod that does not answer keeps its list)."""
        eps = [ep for pod in self._models if (ep := self._endpoints.get(pod)) is not None]
        answers = await asyncio.gather(*(self._served(ep) for ep in eps))  # all at once
        for ep, served in zip(eps, answers):
            if served is not None and self._endpoints.get(ep.pod) is ep and ep.pod in \
                    self._models and served != (self._models[ep.pod], self._adapters[ep.pod]):
                self._activate(ep, *served)

    async def refresh_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh_models()
            except Exception:
                log.exception("refreshing the pods' models failed")

    async def _served(self, ep: Endpoint) -> tuple[list[str], frozenset[str]] | None:
        """(models, those of them LoRA adapters) from the pod's `/v1/models`; a
        configured model replaces the engine's base names. None: no answer."""
        try:
            status, body = await self.http.get(ep.url + "/v1/models", 2.0)
            data = json.loads(body).get("data", [])
            ids = [m["id"] for m in data]
            adapters = frozenset(m["id"] for m in data if m.get("parent"))
        except (*POD_ERRORS, ValueError, KeyError, TypeError, AttributeError):
            return None
        if status != 200 or not ids:
            return None
        if ep.model is not None:
            adapters -= {ep.model}
            ids = [ep.model, *(m for m in ids if m in adapters)]
        return ids, adapters


def _base_model(models: list[str], adapters: frozenset[str]) -> str:
    """The first served name that is not a LoRA adapter."""
    return next((m for m in models if m not in adapters), models[0] if models else "")
