"""Gateway proxy against engines that fail at the byte level: a scripted raw-socket
HTTP/1.1 server per engine, so heads, partial events and stalls are exact."""

import json
import socket
import threading
import time

import httpx
from test_gateway_stack import ThreadServer as Server

from sluice.gateway.app import GATEWAY, Gateway, GatewayConfig, create_app
from sluice.gateway.discovery import Endpoint, StaticDiscovery
from sluice.gateway.proxy import ProxyConfig
from sluice.gateway.routing.config import RoutingConfig

SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
EVENT = b'data: {"choices": [{"index": 0, "text": "t0"}]}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class RawEngine:
    """Answers GETs (/health, /metrics) 200; each POST is handed to `script(conn)`,
    which writes raw bytes; the connection closes after it."""

    def __init__(self, script) -> None:
        self.script = script
        self.posts = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        more = conn.recv(65536)
                        if not more:
                            return
                        data += more
                    head, _, body = data.partition(b"\r\n\r\n")
                    lines = head.decode().split("\r\n")
                    fields = dict(line.lower().split(": ", 1) for line in lines[1:])
                    while len(body) < int(fields.get("content-length", 0)):
                        body += conn.recv(65536)
                    if lines[0].startswith("GET"):
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                        continue
                    self.posts += 1
                    self.script(conn)
                    return
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def ok_json(conn: socket.socket) -> None:
    b = b'{"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "hello"}]}'
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%b" % (len(b), b))


def gateway(*engines: RawEngine, read_timeout_s: float = 5.0):
    eps = [Endpoint(pod=f"127.0.0.1:{e.port}", url=f"http://127.0.0.1:{e.port}", model="m",
                    pool="m") for e in engines]
    cfg = GatewayConfig(routing=RoutingConfig(strategy="round_robin"),
                        proxy=ProxyConfig(max_retries=2, connect_timeout_s=1,
                                          read_timeout_s=read_timeout_s),
                        probe_interval_s=60)
    return create_app(Gateway(cfg, StaticDiscovery(eps)))


def stream(url: str) -> tuple[httpx.Response, list[str]]:
    """The answer and the `data:` payloads of its events (each a whole line)."""
    with httpx.stream("POST", url + "/v1/completions", timeout=10,
                      json={"model": "m", "prompt": "hi", "stream": True}) as r:
        body = r.read().decode()
    return r, [line[6:] for line in body.split("\n") if line.startswith("data: ")]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.count(" ") == 1:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_pod_that_fails_after_its_head_is_marked_unhealthy():
    def dies_after_one_event(conn):
        conn.sendall(SSE_HEAD + chunk(EVENT))

    e = RawEngine(dies_after_one_event)
    with Server(gateway(e)) as gw:
        for _ in range(3):  # max_failures
            r, events = stream(gw.url)
            assert r.status_code == 200 and "error" in json.loads(events[-1])
        assert httpx.get(gw.url + "/health").json()["pods"] == {f"127.0.0.1:{e.port}": False}
        assert stream(gw.url)[0].status_code == 503 and e.posts == 3


def test_an_engine_dying_inside_an_event_never_garbles_the_stream():
    half = b'data: {"choices": [{"index": 0, "text": "t1", "logprobs": {"tok'

    def dies_mid_event(conn):
        conn.sendall(SSE_HEAD + chunk(EVENT + half[:20]))
        time.sleep(0.2)  # the rest of an event arrives later: relayed whole
        conn.sendall(chunk(half[20:] + b'": 1}}]}\n\n' + half))

    e = RawEngine(dies_mid_event)
    with Server(gateway(e)) as gw:
        r, events = stream(gw.url)
    assert r.status_code == 200
    parsed = [json.loads(x) for x in events]  # every event is whole JSON
    assert [p.get("choices", [{}])[0].get("text") for p in parsed[:2]] == ["t0", "t1"]
    assert len(parsed) == 3 and parsed[2]["error"]["code"] == 502


def test_error_answers_carry_the_decision_headers():
    def cut_short(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"id\":")

    def silent(conn):
        time.sleep(2)

    for script, status in ((cut_short, 502), (silent, 504)):
        e = RawEngine(script)
        with Server(gateway(e, read_timeout_s=0.5)) as gw:
            r = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "hi"},
                           timeout=10)
            assert r.status_code == status and r.json()["error"]["message"]
            assert r.headers["x-sluice-pod"] == f"127.0.0.1:{e.port}"
            assert r.headers["x-sluice-prefix-hit-blocks"] == "0"
            if status == 504:  # the failed attempt's time is in the upstream histogram
                assert metric(gw.url, "sluice_gateway_upstream_seconds_count") == 1


def test_a_5xx_whose_body_never_comes_is_retried_without_waiting_for_it():
    def head_only_503(conn):
        conn.sendall(b"HTTP/1.1 503 Busy\r\ncontent-type: application/json\r\n"
                     b"content-length: 50\r\n\r\n")
        time.sleep(30)

    bad, good = RawEngine(head_only_503), RawEngine(ok_json)
    with Server(gateway(bad, good, read_timeout_s=60)) as gw:
        for _ in range(2):  # round robin: one of the two starts on the bad pod
            r = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "hi"},
                           timeout=10)  # (the read timeout, 60 s, would exceed this)
            assert r.status_code == 200 and r.headers["x-sluice-pod"] == f"127.0.0.1:{good.port}"
        assert bad.posts >= 1


def test_rejections_and_internal_errors_are_counted():
    e = RawEngine(ok_json)
    app = gateway(e)
    with Server(app) as gw:
        assert httpx.get(gw.url + "/nope").status_code == 404
        assert httpx.get(gw.url + "/v1/completions").status_code == 405
        assert metric(gw.url, 'sluice_gateway_errors_total{kind="not_found"}') == 2

        async def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        app.state[GATEWAY].router.route = broken
        r = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
        assert metric(gw.url, 'sluice_gateway_errors_total{kind="internal"}') == 1
