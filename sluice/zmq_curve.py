"""ZMQ CURVE for the KV-event sockets: authenticated and encrypted, as pyzmq does it.

A `ZmqSecurity` is built from one folder (a Kubernetes Secret mounted as a volume
has this shape), made by `python -m sluice.zmq_curve init DIR`:

    server.key_secret  the engines' key pair (ZMQ certificate format)
    server.key         its public half
    client.key_secret  the pickers' key pair
    client.key         its public half

Engines bind their PUB and ROUTER sockets as CURVE servers (`as_server`) and
admit only clients whose public key is `client.key` (`authenticator`: a ZAP
handler on the engine's context). Pickers (`as_client`) take `client.key_secret`
and the engines' `server.key`. Without the folder the sockets stay plain, which is how vLLM pools
are reached (behind a NetworkPolicy). The secret halves never leave the folder.

On Kubernetes each side gets only its own files (ENGINE_FILES, PICKER_FILES): an engine
holds no client secret, so a compromised engine cannot read another engine's events.
A leaf module: pyzmq only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER, CLIENT = "server", "client"
# What each side's folder needs: its own key pair and the other side's public key.
ENGINE_FILES = (f"{SERVER}.key_secret", f"{CLIENT}.key")
PICKER_FILES = (f"{CLIENT}.key_secret", f"{SERVER}.key")


@dataclass(frozen=True)
class ZmqSecurity:
    folder: str

    def _pair(self, name: str) -> tuple[bytes, bytes]:
        public, secret = zmq.auth.load_certificate(os.path.join(self.folder,
                                                                f"{name}.key_secret"))
        assert secret is not None, f"{name}.key_secret holds no secret key"
        return public, secret

    def authenticator(self, ctx: zmq.Context) -> ThreadAuthenticator:
        """The context's ZAP handler (one per context), admitting the pickers' public
        key only; it runs until `stop()`."""
        client_public, _ = zmq.auth.load_certificate(os.path.join(self.folder, "client.key"))
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_Only(client_public))
        return auth

    def as_server(self, sock: zmq.Socket) -> None:
        """Make `sock` (before bind) a CURVE server (its context needs `authenticator`)."""
        public, secret = self._pair(SERVER)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True

    def as_client(self, sock: zmq.Socket) -> None:
        """Make `sock` (before connect) a CURVE client of the engines."""
        public, secret = self._pair(CLIENT)
        server_public, _ = zmq.auth.load_certificate(os.path.join(self.folder, "server.key"))
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_serverkey = server_public


class _Only:
    """ZAP's verdict: the pickers' public key, and no other, may connect."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def init(folder: str) -> None:
    """Write a new server and client key pair into `folder`."""
    os.makedirs(folder, exist_ok=True)
    for name in (SERVER, CLIENT):
        zmq.auth.create_certificates(folder, name)


def new_keys() -> dict[str, bytes]:
    """A new server and client key pair: the four files `init` writes, name -> content."""
    with tempfile.TemporaryDirectory(prefix="sluice-curve-") as folder:
        init(folder)
        out = {}
        for name in ENGINE_FILES + PICKER_FILES:
            with open(os.path.join(folder, name), "rb") as fh:
                out[name] = fh.read()
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.zmq_curve")
    p.add_argument("command", choices=["init"])
    p.add_argument("folder")
    args = p.parse_args(argv)
    init(args.folder)
    print(f"CURVE keys written to {args.folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
