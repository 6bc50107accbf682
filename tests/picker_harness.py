"""Test helpers (no tests here): the endpoint picker served in a thread, Envoy in front of
it, and an ext_proc client that speaks to the picker as Envoy does."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from typing import Any, Self

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from sluice.gateway.core import CoreConfig, RoutingCore
from sluice.gateway.discovery.static import Endpoint, StaticDiscovery
from sluice.gateway.envoy.bootstrap import EnvoyConfig
from sluice.gateway.envoy.process import EnvoyProcess
from sluice.gateway.server.api_keys import ApiKeys
from sluice.gateway.server.grpc_server import PickerServer
from sluice.gateway.server.picker import PickerConfig
from sluice.gateway.server.serving_tls import ServingTls


def static_core(ports: Iterable[int], strategy: str = "round_robin", **cfg: Any) -> RoutingCore:
    """A routing core over loopback engines on `ports`, all serving model "m" (pool "m")."""
    eps = [Endpoint(pod=f"127.0.0.1:{p}", url=f"http://127.0.0.1:{p}", model="m", pool="m")
           for p in ports]
    return RoutingCore(CoreConfig(routing=strategy, **cfg),
                       StaticDiscovery(eps))


class PickerThread:
    """A `PickerServer` on a free loopback port, on its own event loop in a thread."""

    def __init__(self, core: RoutingCore, cfg: PickerConfig = PickerConfig(),
                 keys: ApiKeys | None = None, tls: ServingTls | None = None,
                 health_port: int = 0) -> None:
        self.core = core
        self.cfg = cfg
        self.keys = keys
        self.tls = tls
        self.health_port = health_port
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.server = PickerServer(self.core, self.cfg, "127.0.0.1", 0, keys=self.keys,
                                       tls=self.tls, health_port=self.health_port)
            self.port = self.server.port
            self.loop.run_until_complete(self.server.start())
        except BaseException as err:  # noqa: BLE001 -- reported to the test
            self.error = err
            self.started.set()
            return
        self.started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.server.stop(0.5))
        self.loop.close()

    def call(self, fn, timeout: float = 10.0):
        """Run `fn()` on the picker's loop and return its result."""
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def __enter__(self) -> Self:
        self.thread.start()
        self.started.wait(20)
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(15)


class Front:
    """Envoy on a free port, the picker (in a thread) behind it: `url`, `gw` (the core).
    Envoy learns the engines from the picker (EDS), as the chart's does."""

    def __init__(self, gw: RoutingCore, keys: ApiKeys | None = None,
                 tls: ServingTls | None = None, **envoy: Any) -> None:
        self.gw = gw
        self.picker = PickerThread(gw, keys=keys, tls=tls)
        self.envoy_fields = envoy  # more EnvoyConfig fields (TLS to the picker)

    def __enter__(self) -> Self:
        self.picker.__enter__()
        self.envoy = EnvoyProcess(EnvoyConfig(
            listen_host="127.0.0.1", listen_port=0, admin_port=0, picker_port=self.picker.port,
            eds=True, route_prefixes=("/v1/", "/health"), **self.envoy_fields)).start()
        self.url = f"http://127.0.0.1:{self.envoy.listen_port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.envoy.stop()
        self.picker.__exit__(*exc)


def headers(method: str, path: str, end_of_stream: bool = False, **extra: str) -> pb.HttpHeaders:
    items = {":method": method, ":path": path, ":authority": "gw", **extra}
    return pb.HttpHeaders(end_of_stream=end_of_stream, headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]))


def metadata(namespace: str, fields: dict) -> Metadata:
    s = Struct()
    s.update(fields)
    return Metadata(filter_metadata={namespace: s})


class ExtProcClient:
    """One ext_proc stream per `exchange`, as Envoy opens one per HTTP request."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def exchange(self, *requests: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """Send each request after the previous one's answer; stop at an immediate one."""
        import queue

        outbox: queue.Queue = queue.Queue()
        answers: list[pb.ProcessingResponse] = []

        def gen():
            while (item := outbox.get()) is not None:
                yield item

        outbox.put(requests[0])
        stream = self.stub.Process(gen(), timeout=30)
        try:
            for i, answer in enumerate(stream):
                answers.append(answer)
                if answer.HasField("immediate_response") or i + 1 == len(requests):
                    break
                outbox.put(requests[i + 1])
        finally:
            outbox.put(None)
            stream.cancel()
        return answers

    def open(self):
        """A stream the caller drives, as Envoy does over a request's life: put requests in
        the returned outbox (None ends the stream), get the answers from the answers queue."""
        import queue
        import threading

        outbox: queue.Queue = queue.Queue()
        answers: queue.Queue = queue.Queue()

        def gen():
            while (item := outbox.get()) is not None:
                yield item

        stream = self.stub.Process(gen(), timeout=30)
        threading.Thread(target=lambda: [answers.put(a) for a in stream], daemon=True).start()
        return outbox, answers

    def stream(self) -> Stream:
        """A stream the caller drives message by message (`Stream`)."""
        return Stream(self.stub)

    def close(self) -> None:
        self.channel.close()


class Stream:
    """One ext_proc stream driven as Envoy drives it: `send` messages without waiting,
    `get` answers as they come, `end` half-closes it and waits until the picker has ended
    it too (so closing the channel after it cancels nothing)."""

    _END = object()

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        import queue

        self.outbox: queue.Queue = queue.Queue()
        self.answers: queue.Queue = queue.Queue()

        def gen():
            while (item := self.outbox.get()) is not None:
                yield item

        def read():
            try:
                for answer in call:
                    self.answers.put(answer)
            except grpc.RpcError as err:
                self.answers.put(err)
            self.answers.put(self._END)

        call = stub.Process(gen(), timeout=30)
        threading.Thread(target=read, daemon=True).start()

    def send(self, *requests: pb.ProcessingRequest) -> None:
        for r in requests:
            self.outbox.put(r)

    def get(self, timeout: float = 10.0) -> pb.ProcessingResponse:
        answer = self.answers.get(timeout=timeout)
        assert isinstance(answer, pb.ProcessingResponse), answer
        return answer

    def silent(self, wait_s: float = 0.3) -> bool:
        """No answer came within `wait_s` (a bounded look, not a wait for an event)."""
        import queue

        try:
            self.answers.get(timeout=wait_s)
        except queue.Empty:
            return True
        return False

    def end(self) -> None:
        """Half-close; every answer left unread is dropped; the picker's end awaited."""
        self.outbox.put(None)
        while (item := self.answers.get(timeout=10)) is not self._END:
            assert not isinstance(item, grpc.RpcError), item


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)
