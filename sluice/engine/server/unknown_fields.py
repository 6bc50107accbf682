"""Request fields Sluice does not implement: a 400 naming them, never silently ignored.

A field the request models do not declare lands in pydantic's `model_extra`. Harmless
OpenAI fields (bookkeeping that changes nothing about the output: `metadata`,
`store`, ...) are accepted and ignored. Anything else is refused with OpenAI's own
wording, unless the server runs with `--allow-unknown-fields`: then it is ignored
and logged once per field name, as vLLM warns about fields it ignores.
"""

from __future__ import annotations

import logging
import threading

from pydantic import BaseModel

from sluice.engine.server.errors import RequestError

log = logging.getLogger("sluice.engine")

# Fields of OpenAI's API whose only effect is bookkeeping on OpenAI's side.
HARMLESS_FIELDS = frozenset({"metadata", "store", "service_tier", "safety_identifier",
                             "prompt_cache_key", "prompt_cache_retention"})


class UnknownFields:
    """The policy for undeclared fields; `check` is called on every parsed body.

    State: the set of field names already logged, guarded by `_lock` (requests are
    parsed on the event loop, but tests and tools may call from threads)."""

    def __init__(self, allow: bool) -> None:
        self.allow = allow
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: BaseModel) -> None:
        names = sorted(k for k in (body.model_extra or {}) if k not in HARMLESS_FIELDS)
        if not names:
            return
        if not self.allow:
            listed = ", ".join(repr(n) for n in names)
            raise RequestError(f"Unrecognized request argument supplied: {listed} (this "
                               f"server does not implement it; --allow-unknown-fields "
                               f"ignores such fields)", names[0])
        with self._lock:
            new = [n for n in names if n not in self._logged]
            self._logged.update(new)
        if new:
            log.warning("ignoring request field(s) this server does not implement: %s "
                        "(--allow-unknown-fields; logged once per field)", ", ".join(new))
