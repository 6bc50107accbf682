"""A request's scheduling priority (`--scheduling-policy priority`, sched_policy.py).

The engine's priority is vLLM's: lower is served first, 0 by default. It comes from:
1. the gateway's `x-sluice-priority` header: the priority of the request's objective as
   the picker resolved it (GIE's convention: higher is more important), so the engine
   priority is its negation. It wins over the body's field: behind the gateway a client
   could otherwise raise its own request above its objective;
2. else the body's `priority` field (vLLM's), from a client that holds the engine's key.
Under fcfs the header is ignored (the gateway sends it to every engine) and a nonzero
`priority` field is refused, as vLLM refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping

from sluice.engine.server.errors import RequestError

PRIORITY_HEADER = "x-sluice-priority"
MAX_PRIORITY = 2**31 - 1  # bounds of both conventions, so negation stays inside them


def request_priority(headers: Mapping[str, str], body_priority: int, policy: str) -> int:
    """The engine priority of a request (see the module docstring); RequestError (400)
    for a header that is not an integer in bounds, or a priority under fcfs."""
    if policy == "fcfs":
        if body_priority:
            raise RequestError(f"Got priority {body_priority} but priority scheduling is not "
                               "enabled (--scheduling-policy priority).", "priority")
        return 0
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return body_priority
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or abs(value) > MAX_PRIORITY:
        raise RequestError(f"{PRIORITY_HEADER} must be an integer within ±{MAX_PRIORITY}, "
                           f"got {raw[:40]!r}", PRIORITY_HEADER)
    return -value
