"""Pod health from request outcomes: `max_failures` consecutive failures mark a
pod unhealthy; it stays out of routing until a probe of its `/health` succeeds
(`probe_loop`, every `probe_interval_s`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sluice.gateway.http_pool import HTTP_ERRORS, HttpPool

log = logging.getLogger("sluice.gateway.health")


class HealthTracker:
    def __init__(self, max_failures: int = 3, probe_interval_s: float = 1.0) -> None:
        assert max_failures >= 1
        self.max_failures = max_failures
        self.probe_interval_s = probe_interval_s
        self._failures: dict[str, int] = {}
        self._unhealthy: set[str] = set()

    def is_healthy(self, pod: str) -> bool:
        return pod not in self._unhealthy

    def unhealthy(self) -> set[str]:
        return set(self._unhealthy)

    def success(self, pod: str) -> None:
        self._failures[pod] = 0

    def failure(self, pod: str) -> None:
        n = self._failures.get(pod, 0) + 1
        self._failures[pod] = n
        if n >= self.max_failures and pod not in self._unhealthy:
            self._unhealthy.add(pod)
            log.warning("%s marked unhealthy after %d consecutive failures", pod, n)

    def forget(self, pod: str) -> None:
        self._failures.pop(pod, None)
        self._unhealthy.discard(pod)

    async def probe_loop(self, http: HttpPool, url_of: Callable[[str], str | None]) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            for pod in list(self._unhealthy):
                url = url_of(pod)
                if url is None:
                    self.forget(pod)
                    continue
                try:
                    ok = (await http.get(url + "/health", 1.0))[0] == 200
                except HTTP_ERRORS:
                    ok = False
                except Exception:  # noqa: BLE001 -- a bug must not end the probing for good
                    log.exception("probing %s failed", pod)
                    ok = False
                if ok:
                    self.forget(pod)
                    log.warning("%s healthy again (probe succeeded)", pod)
