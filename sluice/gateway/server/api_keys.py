"""Client API keys, checked by the picker before any other work.

Keys come from `--api-key KEY` (named "default") and from `--api-keys-dir DIR`:
one file per key, the file's name is the key's name and its content the key, the
shape of a Kubernetes Secret mounted as a volume. The folder is read again when
it changes (polled every `reload_s`; Kubernetes swaps a Secret's `..data` link),
so keys are added and revoked without a restart. With neither option the
gateway is open, as vLLM without `--api-key`, and says so at start-up; with a
folder it stays keyed even when the folder is empty.

A request must carry `Authorization: Bearer <key>`. Keys are compared by their
SHA-256 digests: one dict lookup, whose time does not depend on how much of a
key matched. Only a key's name ever leaves this module (metrics, access log).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os

log = logging.getLogger("sluice.gateway.keys")

DEFAULT_NAME = "default"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """Read by the event loop's coroutines; `reload` runs there too."""

    def __init__(self, key: str | None = None, folder: str | None = None,
                 reload_s: float = 5.0) -> None:
        assert reload_s > 0
        self.folder, self.reload_s = folder, reload_s
        self._fixed = {_digest(key): DEFAULT_NAME} if key else {}
        self._by_digest = dict(self._fixed)
        self._stamp: tuple | None = None
        if folder is not None:
            self.reload()

    @property
    def open(self) -> bool:
        """No key configured at all. A keys folder makes the gateway keyed even while
        it is empty: revoking the last key must refuse everyone, not open the door."""
        return not self._fixed and self.folder is None

    def __len__(self) -> int:
        return len(self._by_digest)

    def name_of(self, authorization: str | None) -> str | None:
        """The name of the key an `Authorization` header carries; None: no valid key."""
        if not authorization or authorization[:7].lower() != "bearer ":
            return None
        return self._by_digest.get(_digest(authorization[7:].strip()))

    def reload(self) -> None:
        """Read the folder again if it changed (a file added, removed or rewritten)."""
        assert self.folder is not None
        try:
            names = sorted(n for n in os.listdir(self.folder) if not n.startswith("."))
            stamp = tuple((n, os.stat(os.path.join(self.folder, n)).st_mtime_ns) for n in names)
        except OSError as err:
            log.warning("API keys folder %s unreadable (%s); keeping the keys known",
                        self.folder, err)
            return
        if stamp == self._stamp:
            return
        keys = dict(self._fixed)
        for name in names:
            path = os.path.join(self.folder, name)
            try:
                if not os.path.isfile(path):
                    continue
                with open(path, encoding="utf-8") as f:
                    key = f.read().strip()
            except (OSError, UnicodeDecodeError) as err:  # (a Secret swapped mid-read)
                log.warning("API key file %s unreadable (%s); skipped", name, err)
                continue
            if key:
                keys[_digest(key)] = name
        if self._stamp is not None:
            log.info("API keys reloaded: %d key(s)", len(keys))
        self._by_digest, self._stamp = keys, stamp

    async def reload_loop(self) -> None:
        while self.folder is not None:
            await asyncio.sleep(self.reload_s)
            try:
                self.reload()
            except Exception:  # the loop must outlive any one bad read: revocations depend on it
                log.exception("reloading the API keys failed; trying again")
