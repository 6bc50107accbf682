"""The proxy's in-flight table: per-pod counts, and speculative entries renewed
only while a request's prefill is pending."""

import asyncio

from sluice.gateway.load.inflight import InFlight
from sluice.gateway.routing.scheduler import Decision


def test_renewed_while_the_prefill_is_pending_then_never_again():
    async def main():
        renewed = []
        flight = InFlight(renewed.append, renew_every_s=0.02)
        d = Decision("a:1", "kv_aware", 1, 4, "redis", ("k2", "k3", "k4"),
                     prefill_tokens=48)
        other = Decision("a:1", "round_robin", 0, 0, "none")  # no entries
        attempt, plain = flight.start(d), flight.start(other)
        assert flight.inflight == {"a:1": 2} and flight.pending_prefill == {"a:1": 48}
        await asyncio.sleep(0.11)
        assert 3 <= len(renewed) <= 6 and set(renewed) == {d}
        attempt.prefilled()
        assert flight.pending_prefill == {} and flight.inflight == {"a:1": 2}
        n = len(renewed)
        await asyncio.sleep(0.06)
        assert len(renewed) == n, "no renewal once the answer began"
        for _ in range(2):  # idempotent
            attempt.done()
            plain.done()
        assert flight.inflight == {} and flight.pending_prefill == {}
        failed = flight.start(d)
        failed.done()  # a request that never got an answer stops renewing too
        await asyncio.sleep(0.05)
        assert len(renewed) == n and flight.inflight == {} and flight.pending_prefill == {}
    asyncio.run(main())
