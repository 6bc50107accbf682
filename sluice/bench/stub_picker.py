"""A do-nothing endpoint picker: the floor under `sluice epp` (path `envoy_stub` of
`serve_overhead`).

    python -m sluice.bench.stub_picker --port 9002 --endpoint 127.0.0.1:8000

What issue 16 calls the floor the routing work sits on: Envoy plus a Python ext_proc
server on grpc.aio that sends every completion to one fixed endpoint, with no parsing,
tokenizing, routing, Redis or in-flight accounting. It runs `sluice epp`'s gRPC server
options, listener, event loop and answer shapes (body first, route by metadata), so the
latency and CPU between this path and `envoy_picker` in one run are the picker's own work.
"""

from __future__ import annotations

import argparse
import os

from sluice.gateway.server.cli import LISTENER_EXPERIMENT, run_loop


# gRPC (and the stubs that import it) loads inside the functions: main sets
# GRPC_EXPERIMENTS first, as `sluice epp` does.
def _servicer(endpoint: str):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from sluice.gateway.server import messages as msg

    route = msg.body_first(msg.route_to((endpoint,), after_body=True),
                           remove=msg.PICKER_HEADERS, key_name=None)
    answers = {"request_headers": msg.CONTINUE_OPEN, "request_body": route,
               "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
               "response_body": msg.RESPONSE_BODY_CONTINUE,
               "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
               "response_trailers": msg.RESPONSE_TRAILERS_CONTINUE}

    class Stub(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):
            async for req in request_iterator:
                yield answers[req.WhichOneof("request")]

    return Stub(), pb_grpc


async def serve(port: int, endpoint: str) -> None:
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    from sluice.gateway.server.grpc_server import EXT_PROC_SERVICE, SERVER_OPTIONS

    server = grpc.aio.server(options=SERVER_OPTIONS)
    stub, pb_grpc = _servicer(endpoint)
    pb_grpc.add_ExternalProcessorServicer_to_server(stub, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("liveness", "readiness", "", EXT_PROC_SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise OSError(f"cannot listen on 127.0.0.1:{port}")
    await server.start()
    try:
        await server.wait_for_termination()
    except asyncio.CancelledError:
        await server.stop(0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sluice.bench.stub_picker")
    p.add_argument("--port", type=int, default=9002)
    p.add_argument("--endpoint", required=True, help="ip:port every completion goes to")
    args = p.parse_args(argv)
    os.environ.setdefault("GRPC_EXPERIMENTS", LISTENER_EXPERIMENT)  # (before grpc loads)
    run_loop(serve(args.port, args.endpoint))


if __name__ == "__main__":
    main()
