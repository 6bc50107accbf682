"""The operator's identity on the API server, re-read as it rotates.

In a pod the kubelet projects the ServiceAccount token into a file and writes a new one
before the old expires (at 80 % of its lifetime: an hour by default, so the old one is
refused some 12 minutes later). A token read once at start therefore breaks the operator
after about an hour. Both clients follow the file instead:

- kopf's: its login handler returns `Login.connection()`, which reads the file afresh. kopf
  calls it at start and again after any 401, then repeats the refused request.
- ours (`kube.KubeClient`): `TokenAuth` sets the header from `TokenFile.current()`, which
  re-reads the file at most every `max_age_s` (60 s, as client-go's cached token source)
  and at once after a 401, then repeats the request once with the new token.

Outside a pod (kubeconfig, tests) the connection is fixed: `Login(info)`.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import httpx

log = logging.getLogger("sluice.operator")

SA_DIR = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")


class TokenFile:
    """A bearer token kept in a file that something else replaces (never logged).
    Used from the operator's event loop only: reads are a few microseconds, not worth a thread."""

    def __init__(self, path: str | pathlib.Path, max_age_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.max_age_s, self.clock = pathlib.Path(path), max_age_s, clock
        self._token: str | None = None
        self._read_at = 0.0
        self.reloads = 0  # times the file was read (for tests)

    def current(self) -> str:
        """The token, read again when the cached copy is older than `max_age_s`."""
        if self._token is None or self.clock() - self._read_at >= self.max_age_s:
            return self.reload()
        return self._token

    def reload(self) -> str:
        token = self.path.read_text(encoding="utf-8").strip()
        if self._token is not None and token != self._token:
            log.info("ServiceAccount token changed (%s): using the new one", self.path)
        self._token, self._read_at = token, self.clock()
        self.reloads += 1
        return token


class TokenAuth(httpx.Auth):
    """httpx auth from a `TokenFile`; a 401 re-reads the file and repeats the request once."""

    def __init__(self, token: TokenFile) -> None:
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        sent = self.token.current()
        request.headers["Authorization"] = f"Bearer {sent}"
        response = yield request
        if response.status_code == 401:
            fresh = self.token.reload()
            if fresh != sent:
                request.headers["Authorization"] = f"Bearer {fresh}"
                yield request


@dataclass(frozen=True)
class Login:
    """How the operator logs in: `info` (server, CA, ...) and, in a pod, the token file
    whose content replaces `info.token` on every login."""

    info: Any  # kopf.ConnectionInfo
    token_file: TokenFile | None = None

    def connection(self) -> Any:
        """kopf's login handler: the connection with the token as the file holds it now."""
        if self.token_file is None:
            return self.info
        return dataclasses.replace(self.info, token=self.token_file.reload())

    def http_auth(self) -> httpx.Auth | None:
        """For `kube.KubeClient.from_connection`: None when the info's own token is fixed."""
        return TokenAuth(self.token_file) if self.token_file is not None else None


def service_account_login(settings: Any) -> Login | None:
    """In a pod: kopf's own ServiceAccount login (server, CA, namespace) + the token file."""
    import kopf

    info = kopf.login_with_service_account(settings=settings)
    if info is None:
        return None
    return Login(info, TokenFile(SA_DIR / "token"))  # the path kopf reads the token from
