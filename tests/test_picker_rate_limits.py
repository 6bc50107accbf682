"""Per-key limits shared by two picker replicas through one Redis (`rate_limit.py`)."""

import asyncio
import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from picker_harness import ExtProcClient, PickerThread, headers, wait_for
from redis_server import RedisServer

from sluice.gateway.core import CoreConfig, RoutingCore
from sluice.gateway.discovery.static import Endpoint, StaticDiscovery
from sluice.gateway.server.api_keys import ApiKeys
from sluice.gateway.server.picker import PickerConfig
from sluice.gateway.server.rate_limit import Limits, RateLimiter


def ask(client, key, body):
    answers = client.exchange(
        pb.ProcessingRequest(request_headers=headers("POST", "/v1/completions",
                                                     authorization=f"Bearer {key}")),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(body).encode(),
                                                      end_of_stream=True)))
    last = answers[-1]
    if last.HasField("immediate_response"):
        r = last.immediate_response
        return r.status.code, {h.header.key: h.header.raw_value.decode()
                               for h in r.headers.set_headers}
    return 200, {}


def test_two_replicas_share_each_keys_request_count():
    with RedisServer() as redis_srv, Server(fake_engine("ok", {})) as up:
        ep = Endpoint(pod=f"127.0.0.1:{up.port}", url=up.url, model="m", pool="m")
        cfg = PickerConfig(limits=Limits(requests_per_minute=4))
        keys = ApiKeys("sk-a")
        replicas = []
        for _ in range(2):
            core = RoutingCore(CoreConfig(routing="round_robin",
                                          redis_url=redis_srv.url), StaticDiscovery([ep]))
            replicas.append(PickerThread(core, cfg, keys=keys).__enter__())
        try:
            clients = [ExtProcClient(r.port) for r in replicas]
            for r in replicas:
                wait_for(lambda r=r: len(r.core.registry.active()) == 1)
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            codes = [ask(clients[i % 2], "sk-a", body) for i in range(6)]
            assert [c for c, _ in codes] == [200, 200, 200, 200, 429, 429]
            assert 1 <= int(codes[4][1]["retry-after"]) <= 60
        finally:
            for r in replicas:
                r.__exit__(None, None, None)


def test_tokens_are_counted_only_when_admitted_and_keys_apart():
    limiter = RateLimiter(Limits(tokens_per_minute=100))  # (no Redis: this replica alone)
    assert asyncio.run(limiter.admit("k", 60, now=120.0)) is None
    assert asyncio.run(limiter.admit("k", 50, now=130.0)) == 50  # over: wait to 180 s ...
    assert asyncio.run(limiter.admit("k", 30, now=170.0)) is None  # ... and not counted
    assert asyncio.run(limiter.admit("k", 30, now=171.0)) == 9
    assert asyncio.run(limiter.admit("k", 30, now=181.0)) is None  # a new minute
    assert asyncio.run(limiter.admit("other", 90, now=181.0)) is None  # keys apart


def test_a_requests_cost_counts_every_prompt_and_n_completions():
    from sluice.gateway.server.picker import UNBOUNDED_COMPLETION_TOKENS, _requested_tokens

    assert _requested_tokens({"max_tokens": 50, "n": 4}) == 200
    assert _requested_tokens({"max_completion_tokens": 7}) == 7
    assert _requested_tokens({}) == UNBOUNDED_COMPLETION_TOKENS
    assert _requested_tokens({"max_tokens": "5", "n": True}) == UNBOUNDED_COMPLETION_TOKENS
