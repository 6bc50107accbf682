"""Pod health: a property of the pod, never the verdict of one request.

Two sources, as Envoy's active health checks and outlier detection:
- **Probes** (`probe_loop`): every pod's `/health` each `probe_interval_s`.
  `probe_failures` failures in a row mark a pod *down*; one success brings it
  back. This is the pod's own word (our engine answers 503 once its engine
  thread died), so it is not bounded.
- **Failed attempts** (`connection_failure`): Envoy went on to a fallback
  because the chosen pod refused or reset the connection, or answered 503
  before any byte (the response names another pod, or none). `max_failures`
  in a row *eject* the pod until a probe succeeds; any answer it serves resets
  the count. Ejection is bounded: at most `max(1, max_ejection_fraction × pods)`
  pods are ejected at once, so no run of failures, whoever causes them, can
  empty the pool.

An HTTP answer of another status is not a failure: the pod was reached and
spoke HTTP. A 500 that a request gets is either the request's doing (every pod
would say the same) or the pod's (its `/health` says so): it is relayed as it
is, never retried across the pool, and the probes judge the pod.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sluice.gateway.discovery.pod_client import POD_ERRORS, PodClient

log = logging.getLogger("sluice.gateway.discovery.health")


class HealthTracker:
    """Owned by the event loop's thread: every method runs there."""

    def __init__(self, max_failures: int = 3, probe_interval_s: float = 1.0,
                 max_ejection_fraction: float = 0.5, probe_failures: int = 2,
                 pool_size: Callable[[], int] = lambda: 1) -> None:
        assert max_failures >= 1 and probe_failures >= 1 and probe_interval_s > 0
        assert 0.0 <= max_ejection_fraction <= 1.0
        self.max_failures = max_failures
        self.probe_interval_s = probe_interval_s
        self.max_ejection_fraction = max_ejection_fraction
        self.probe_failures = probe_failures
        self.pool_size = pool_size
        self._failures: dict[str, int] = {}  # consecutive connection failures
        self._probe_failed: dict[str, int] = {}  # consecutive failed probes
        self._ejected: set[str] = set()
        self._down: set[str] = set()

    def is_healthy(self, pod: str) -> bool:
        return pod not in self._ejected and pod not in self._down

    def unhealthy(self) -> set[str]:
        return self._ejected | self._down

    def success(self, pod: str) -> None:
        self._failures[pod] = 0

    def connection_failure(self, pod: str) -> None:
        n = self._failures.get(pod, 0) + 1
        self._failures[pod] = n
        if n < self.max_failures or pod in self._ejected:
            return
        room = max(1, int(self.max_ejection_fraction * self.pool_size())) - len(self._ejected)
        if room <= 0:
            log.warning("%s failed %d connections in a row; not ejected: %d pods already "
                        "are (the bound)", pod, n, len(self._ejected))
            return
        self._ejected.add(pod)
        log.warning("%s ejected after %d connection failures in a row", pod, n)

    def probed(self, pod: str, ok: bool) -> None:
        if ok:
            self._probe_failed[pod] = 0
            self._failures[pod] = 0
            if pod in self._down or pod in self._ejected:
                log.warning("%s healthy again (probe succeeded)", pod)
            self._down.discard(pod)
            self._ejected.discard(pod)
            return
        n = self._probe_failed.get(pod, 0) + 1
        self._probe_failed[pod] = n
        if n >= self.probe_failures and pod not in self._down:
            self._down.add(pod)
            log.warning("%s down: %d failed /health probes in a row", pod, n)

    def forget(self, pod: str) -> None:
        self._failures.pop(pod, None)
        self._probe_failed.pop(pod, None)
        self._ejected.discard(pod)
        self._down.discard(pod)

    async def probe_loop(self, http: PodClient, pods: Callable[[], list[str]],
                         url_of: Callable[[str], str | None]) -> None:
        """Probe every pod, all at once, each `probe_interval_s`."""
        while True:
            await asyncio.sleep(self.probe_interval_s)
            targets = [(p, u) for p in pods() if (u := url_of(p)) is not None]
            results = await asyncio.gather(*(self._probe(http, u) for _, u in targets))
            still = set(pods())  # (a pod removed during the probes is forgotten already)
            for (pod, _), ok in zip(targets, results, strict=True):
                if pod in still:
                    self.probed(pod, ok)

    async def _probe(self, http: PodClient, url: str) -> bool:
        try:
            return (await http.get(url + "/health", max(1.0, self.probe_interval_s)))[0] == 200
        except POD_ERRORS:
            return False
        except Exception:
            log.exception("probing %s failed", url)
            return False
