"""Kubernetes Events about pools, written with the operator's own client.

kopf's `kopf.event` only works inside kopf's per-object tasks; the periodic loop
(`ticker.py`) and the retries after a backoff (`retry.py`) run outside them, and they
report too (a scale-up, a rejected child). `EventPoster` is the `EventSink` every part
uses: it never blocks the caller (each Event is posted by a task of its own) and never
fails it (Events are best effort: a failed post is logged and dropped).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
from collections.abc import Mapping
from typing import Any

from sluice import labels
from sluice.operator import kube

log = logging.getLogger("sluice.operator")

MAX_MESSAGE = 1024  # the API server refuses longer Event messages


def render_event(body: Mapping[str, Any], type_: str, reason: str, message: str,
                 now: str, instance: str) -> dict[str, Any]:
    """Pure: a core/v1 Event about the object `body`."""
    meta = body["metadata"]
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace")},
        "involvedObject": {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                           "name": meta["name"], "namespace": meta.get("namespace"),
                           "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:MAX_MESSAGE],
        "source": {"component": labels.OPERATOR_NAME},
        "reportingComponent": labels.OPERATOR_NAME, "reportingInstance": instance,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventPoster:
    """Owns the tasks of the Events being posted; all on the operator's event loop."""

    def __init__(self, client: kube.KubeClient, instance: str | None = None) -> None:
        self.client = client
        self.instance = instance or socket.gethostname()  # the pod's name in a pod
        self._pending: set[asyncio.Task[None]] = set()

    def __call__(self, body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        event = render_event(body, type_, reason, message, _now(), self.instance)
        task = asyncio.get_running_loop().create_task(self._post(event))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _post(self, event: dict[str, Any]) -> None:
        try:
            await self.client.create(kube.EVENTS, event["metadata"]["namespace"], event)
        except Exception as e:  # noqa: BLE001 -- best effort, as kopf's own Events
            log.warning("Event %s about %s not posted: %s", event["reason"],
                        event["involvedObject"]["name"], e)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait a little for the Events already handed over (at shutdown)."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout_s)
