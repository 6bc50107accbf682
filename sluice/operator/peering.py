"""Whether this replica is the one that acts, for work kopf does not schedule itself.

kopf pauses its handlers on a replica while its peering object lists a live peer with a
higher priority, or another with the same priority (then every replica pauses), and while
the peering object is missing. kopf keeps that state to itself, and the periodic loop
(`ticker.py`) runs outside kopf's handlers (kopf's per-pool timers would put a finalizer
on every pool), so it reads the same objects and applies the same rule
(kopf/_core/engines/peering.py, `process_peering_event`) before each round.

Our own entry is recognised by its priority: replicas draw random 31-bit priorities
(`OperatorConfig.priority`), so two live entries with ours mean a tie, as for kopf.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from sluice.operator import kube
from sluice.operator.config import OperatorConfig


def _live(entry: Mapping[str, Any], now: datetime.datetime) -> bool:
    seen = entry.get("lastseen")
    if not seen:
        return True  # kopf counts an entry without a timestamp as seen now
    last = datetime.datetime.fromisoformat(str(seen))
    if last.tzinfo is None:
        last = last.replace(tzinfo=datetime.UTC)
    return last + datetime.timedelta(seconds=int(entry.get("lifetime", 60))) > now


def acting(status: Mapping[str, Any] | None, priority: int, now: datetime.datetime) -> bool:
    """Pure: kopf's rule on one peering object's status ({peer id: {priority, lifetime,
    lastseen}}): no live peer above `priority`, and none besides us at it."""
    live = [int(e.get("priority", 0)) for e in (status or {}).values() if _live(e, now)]
    return not any(p > priority for p in live) and sum(p == priority for p in live) <= 1


async def is_acting(client: kube.KubeClient, config: OperatorConfig) -> bool:
    """Read the peering object(s) kopf uses: the ClusterKopfPeering when cluster-wide, else
    the KopfPeering of every watched namespace (kopf pauses when any of them says so)."""
    if config.standalone:
        return True
    now = datetime.datetime.now(datetime.UTC)
    refs = ([(kube.CLUSTER_PEERINGS, None)] if config.clusterwide else
            [(kube.PEERINGS, ns) for ns in config.namespaces])
    for ref, namespace in refs:
        try:
            peering = await client.get(ref, namespace, config.peering_name)
        except kube.NotFound:
            return False  # kopf pauses too while its peering object is missing
        if not acting(peering.get("status"), config.priority, now):
            return False
    return True
