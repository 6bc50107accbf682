"""Gateway proxy behaviour against small fake OpenAI-compatible upstreams
(the engine is not the subject here: failure modes are scripted)."""

import asyncio
import json
import time

import httpx
import pytest
from engine_server import free_port
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from test_gateway_stack import ThreadServer as Server

from sluice.gateway.app import GATEWAY, Gateway, GatewayConfig, create_app
from sluice.gateway.discovery import Endpoint, StaticDiscovery
from sluice.gateway.proxy import ProxyConfig
from sluice.gateway.routing.config import RoutingConfig


def fake_engine(mode, state):
    """mode: ok | error500 (its /health too) | poisoned (500 to the prompt "poison",
    healthy) | busy429 | die_midstream | slow | stall (answers after 5 s) | prefill
    (answers after 1.5 s)."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=200 if mode != "error500" else 500)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.get("model", "m"), "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return StreamingResponse(iter([b"vllm:num_requests_waiting{model_name=\"m\"} 0\n"]))

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        state["calls"] = state.get("calls", 0) + 1
        if mode == "error500" or mode == "poisoned" and body.get("prompt") == "poison":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if mode == "busy429":
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429,
                                headers={"retry-after": "1"})
        if mode in ("stall", "prefill"):
            await asyncio.sleep(5 if mode == "stall" else 1.5)
        if not body.get("stream"):
            return {"id": "x", "object": "text_completion", "model": body["model"],
                    "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}]}

        async def gen():
            try:
                for i in range(50 if mode == "slow" else 3):
                    chunk = {"id": "x", "object": "text_completion",
                             "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await asyncio.sleep(0.3 if mode in ("slow", "ok") else 0.05)
                    if mode == "die_midstream" and i == 1:
                        raise RuntimeError("engine died")
                yield b"data: [DONE]\n\n"
            finally:
                state["closed_at"] = time.time()

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def gateway_app(upstreams, strategy="round_robin", read_timeout_s=5.0,
                speculative_ttl_ms=60_000, probe_interval_s=0.2, **cfg):
    """`upstreams`: (Server or a bare port, model) pairs; a model of None is asked
    from the pod."""
    eps = []
    for u, m in upstreams:
        port = u if isinstance(u, int) else u.port
        eps.append(Endpoint(pod=f"127.0.0.1:{port}", url=f"http://127.0.0.1:{port}", model=m,
                            pool=m))
    config = GatewayConfig(routing=RoutingConfig(strategy=strategy,
                                                 speculative_ttl_ms=speculative_ttl_ms),
                           max_body_bytes=4096,
                           proxy=ProxyConfig(max_retries=2, connect_timeout_s=1,
                                             read_timeout_s=read_timeout_s),
                           probe_interval_s=probe_interval_s, **cfg)
    return create_app(Gateway(config, StaticDiscovery(eps)))


def post(url, body, **kw):
    return httpx.post(url + "/v1/completions", content=body if isinstance(body, bytes)
                      else json.dumps(body), timeout=10, **kw)


def test_bad_input_is_openai_shaped():
    st = {}
    with Server(fake_engine("ok", st)) as up, Server(gateway_app([(up, "m")])) as gw:
        cases = [(b"{not json", 400), (json.dumps({"prompt": "x"}).encode(), 400),
                 (json.dumps([1, 2]).encode(), 400),
                 (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404),
                 (json.dumps({"model": "m", "prompt": "x" * 5000}).encode(), 413),
                 (b'{"model": "m", "prompt": ' + b"[" * 1800 + b"]" * 1800 + b"}", 400),
                 (json.dumps({"model": "m", "prompt": [[[1]]]}).encode(), 400),
                 (json.dumps({"model": "m", "prompt": [2**70, 1]}).encode(), 400),
                 (json.dumps({"model": "m", "prompt": [-1]}).encode(), 400),
                 (json.dumps({"model": "m", "prompt": [[5, 2**40]]}).encode(), 400),
                 (json.dumps({"model": "m", "prompt": []}).encode(), 400),
                 (b'{"model": "m", "prompt": "x", "temperature": NaN}', 400)]
        for body, status in cases:
            r = post(gw.url, body)
            assert r.status_code == status, (body[:30], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
        chat = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": []})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert httpx.get(gw.url + "/nope").json()["error"]["type"]
        assert st.get("calls", 0) == 0


def wait_for(predicate, timeout=5.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_failing_probe_or_refused_connections_take_a_pod_out():
    st_bad, st_ok = {}, {}
    dead_port = free_port()  # nothing listens there: connect errors
    with Server(fake_engine("error500", st_bad)) as bad, \
            Server(fake_engine("ok", st_ok)) as ok:
        with Server(gateway_app([(bad, "m"), (dead_port, "m"), (ok, "m")])) as gw:
            for _ in range(4):
                r = post(gw.url, {"model": "m", "prompt": "hi"})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
                assert r.headers["x-sluice-pod"] == f"127.0.0.1:{ok.port}"
            # the 500s alone mark nothing: the bad pod's /health (500) takes it out
            pods = lambda: httpx.get(gw.url + "/health").json()["pods"]  # noqa: E731
            wait_for(lambda: pods()[f"127.0.0.1:{bad.port}"] is False)
            assert pods()[f"127.0.0.1:{ok.port}"] is True
            calls = st_bad["calls"]
            post(gw.url, {"model": "m", "prompt": "hi"})
            assert st_bad["calls"] == calls  # down: no longer tried
            metrics = httpx.get(gw.url + "/metrics").text
            assert 'sluice_gateway_errors_total{kind="upstream_5xx"}' in metrics
            assert "sluice_gateway_retries_total" in metrics


def test_an_error_every_pod_gives_is_relayed_and_marks_no_pod():
    """A request that makes the engines fail (a 5xx from client input) reaches
    at most two pods, gets the engine's own answer, and leaves the pool whole:
    the surrogate flood of the security issue, with scripted engines."""
    a_st, b_st = {}, {}
    with Server(fake_engine("poisoned", a_st)) as a, Server(fake_engine("poisoned", b_st)) as b:
        app = gateway_app([(a, "m"), (b, "m")], max_failures=1)
        with Server(app) as gw:
            calls = lambda: a_st.get("calls", 0) + b_st.get("calls", 0)  # noqa: E731
            for _ in range(20):
                before = calls()
                r = post(gw.url, {"model": "m", "prompt": "poison"})
                assert r.status_code == 500 and r.json()["error"]["message"] == "boom"
                assert calls() - before == 2  # tried once more, not across the pool
                ok = post(gw.url, {"model": "m", "prompt": "hi"})
                assert ok.status_code == 200, ok.text
            assert all(httpx.get(gw.url + "/health").json()["pods"].values())


def test_ejection_is_bounded_to_a_fraction_of_the_pool():
    dead = [free_port() for _ in range(4)]
    app = gateway_app([(p, "m") for p in dead], probe_interval_s=60, max_failures=1)
    health = app.state[GATEWAY].health
    with Server(app) as gw:
        for _ in range(6):
            assert post(gw.url, {"model": "m", "prompt": "hi"}).status_code == 503
        # 4 pods, fraction 0.5: two ejected at most, whatever the failures
        assert len(health.unhealthy()) == 2


def test_no_pod_left_is_503():
    app = gateway_app([(free_port(), "m")])
    with Server(app) as gw:
        r = post(gw.url, {"model": "m", "prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "ServiceUnavailableError"


def test_every_engine_busy_is_429():
    st1, st2 = {}, {}
    with Server(fake_engine("busy429", st1)) as a, Server(fake_engine("busy429", st2)) as b, \
            Server(gateway_app([(a, "m"), (b, "m")])) as gw:
        r = post(gw.url, {"model": "m", "prompt": "hi"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["message"] == "queue full"
        assert st1["calls"] == 1 and st2["calls"] == 1
        health = httpx.get(gw.url + "/health").json()
        assert all(health["pods"].values())  # busy is not unhealthy


def test_model_names_a_gateway_never_saw_stay_404_while_an_engine_is_being_asked():
    dead_port = free_port()  # its model is never learned
    with Server(gateway_app([(dead_port, None)])) as gw:
        r = post(gw.url, {"model": "m", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
    # (a model an engine served, with none ready now: 503, see test_gateway_registry)


def test_engine_silent_past_the_read_timeout_is_504_and_counts_as_a_failure():
    st = {}
    with Server(fake_engine("stall", st)) as up, \
            Server(gateway_app([(up, "m")], read_timeout_s=0.3, probe_interval_s=60)) as gw:
        # (its /health answers, so a probe would mark it healthy again: none runs here)
        for _ in range(3):
            r = post(gw.url, {"model": "m", "prompt": "hi"})
            assert r.status_code == 504 and r.json()["error"]["code"] == 504
        assert httpx.get(gw.url + "/health").json()["pods"][f"127.0.0.1:{up.port}"] is False


def test_internal_error_is_an_openai_shaped_500():
    async def broken(*args, **kw):
        raise RuntimeError("bug")

    app = gateway_app([(free_port(), "m")])
    app.state[GATEWAY].router.route = broken
    with Server(app) as gw:
        r = post(gw.url, {"model": "m", "prompt": "hi"})
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
        assert httpx.get(gw.url + "/health").status_code in (200, 503)  # still serving


def test_stream_is_passed_through_chunk_by_chunk():
    st = {}
    with Server(fake_engine("ok", st)) as up, Server(gateway_app([(up, "m")])) as gw:
        t0 = time.time()
        arrivals = []
        with httpx.stream("POST", gw.url + "/v1/completions",
                          json={"model": "m", "prompt": "hi", "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.time() - t0)
        assert len(arrivals) == 4
        # the engine sleeps 0.3 s between chunks: buffered, they would arrive together
        assert arrivals[-1] - arrivals[0] > 0.6


def test_upstream_death_mid_stream_ends_with_error_event():
    st = {}
    with Server(fake_engine("die_midstream", st)) as up, \
            Server(gateway_app([(up, "m")])) as gw:
        events = []
        with httpx.stream("POST", gw.url + "/v1/completions",
                          json={"model": "m", "prompt": "hi", "stream": True}, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert len(events) == 3
        assert json.loads(events[-1])["error"]["code"] == 502


def test_client_disconnect_cancels_upstream():
    st = {}
    with Server(fake_engine("slow", st)) as up, Server(gateway_app([(up, "m")])) as gw:
        with httpx.stream("POST", gw.url + "/v1/completions",
                          json={"model": "m", "prompt": "hi", "stream": True}) as r:
            next(r.iter_lines())
            left = time.time()
        deadline = time.time() + 5
        while "closed_at" not in st and time.time() < deadline:
            time.sleep(0.05)
        assert "closed_at" in st and st["closed_at"] - left < 3  # 50 chunks would take 15 s


def test_models_from_every_pool():
    sa, sb = {"model": "alpha"}, {"model": "beta"}
    with Server(fake_engine("ok", sa)) as a, Server(fake_engine("ok", sb)) as b, \
            Server(gateway_app([(a, "alpha"), (b, "beta")], strategy="least_load")) as gw:
        ids = [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]]
        assert ids == ["alpha", "beta"]
        r = post(gw.url, {"model": "beta", "prompt": "x"})
        assert r.headers["x-sluice-pod"] == f"127.0.0.1:{b.port}"
        assert r.headers["x-sluice-strategy"] == "least_load"


def test_pending_prefill_and_inflight_are_released():
    st = {}
    with Server(fake_engine("ok", st)) as up:
        app = gateway_app([(up, "m")], strategy="kv_aware")
        gw = app.state[GATEWAY]
        with Server(app) as server:
            with httpx.stream("POST", server.url + "/v1/completions", json={
                    "model": "m", "prompt": list(range(70)), "stream": True}) as r:
                assert r.headers["x-sluice-prompt-blocks"] == "4"
                lines = r.iter_lines()
                next(lines)
                flight = gw.proxy.flight
                assert flight.pending_prefill == {} and sum(flight.inflight.values()) == 1
                list(lines)
            deadline = time.time() + 5
            while flight.inflight and time.time() < deadline:
                time.sleep(0.05)
            assert flight.inflight == {} and flight.pending_prefill == {}
            # a second identical prompt: the speculative entry makes it a full hit
            r = post(server.url, {"model": "m", "prompt": list(range(70))})
            assert r.headers["x-sluice-prefix-hit-blocks"] == "4"


def truncating_engine():
    """A raw HTTP/1.1 engine whose JSON answer promises 1000 bytes, sends 12 and closes."""
    from test_gateway_proxy_failures import RawEngine

    return RawEngine(lambda conn: conn.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n{\"id\": \"x\", "))


def test_engine_dying_inside_a_json_answer_is_a_502():
    engine = truncating_engine()
    try:
        app = gateway_app([(engine.port, "m")])
        with Server(app) as gw:
            r = post(gw.url, {"model": "m", "prompt": "hi"})
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == 502
            proxy = app.state[GATEWAY].proxy
            assert proxy.flight.inflight == {} and proxy.flight.pending_prefill == {}
    finally:
        engine.close()


def test_client_gone_before_the_first_byte_releases_the_pod():
    st = {}
    with Server(fake_engine("stall", st)) as up:
        app = gateway_app([(up, "m")], strategy="kv_aware")
        proxy = app.state[GATEWAY].proxy
        with Server(app) as gw:
            with pytest.raises(httpx.ReadTimeout):  # the engine answers only after 5 s
                httpx.post(gw.url + "/v1/completions", timeout=httpx.Timeout(10, read=2),
                           json={"model": "m", "prompt": list(range(64))})
            assert st.get("calls") == 1
            deadline = time.time() + 10
            while proxy.flight.inflight and time.time() < deadline:
                time.sleep(0.05)
            assert proxy.flight.inflight == {} and proxy.flight.pending_prefill == {}


def test_speculative_entries_last_while_the_prefill_outlasts_their_ttl():
    """A prefill of 1.5 s against a 300 ms TTL: a request of the same prompt 0.9 s
    later still finds the first one's pod (entries renewed while its answer has
    not begun), instead of prefilling the prompt again elsewhere."""
    from concurrent.futures import ThreadPoolExecutor

    with Server(fake_engine("prefill", {})) as a, Server(fake_engine("prefill", {})) as b:
        app = gateway_app([(a, "m"), (b, "m")], strategy="kv_aware", speculative_ttl_ms=300)
        flight = app.state[GATEWAY].proxy.flight
        with Server(app) as server, ThreadPoolExecutor(1) as ex:
            body = {"model": "m", "prompt": list(range(70))}
            first = ex.submit(post, server.url, body)
            time.sleep(0.9)
            second = post(server.url, body)
            first = first.result()
            assert second.headers["x-sluice-prefix-hit-blocks"] == "4"
            assert second.headers["x-sluice-pod"] == first.headers["x-sluice-pod"]
            assert flight.inflight == {} and flight.pending_prefill == {}


def test_a_salted_request_is_routed_on_its_own_keys():
    with Server(fake_engine("ok", {})) as up, \
            Server(gateway_app([(up, "m")], strategy="kv_aware")) as gw:
        body = {"model": "m", "prompt": list(range(70))}
        assert post(gw.url, body).headers["x-sluice-prefix-hit-blocks"] == "0"
        assert post(gw.url, body).headers["x-sluice-prefix-hit-blocks"] == "4"
        salted = {**body, "cache_salt": "tenant-b"}
        assert post(gw.url, salted).headers["x-sluice-prefix-hit-blocks"] == "0"
        assert post(gw.url, salted).headers["x-sluice-prefix-hit-blocks"] == "4"
