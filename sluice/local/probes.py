"""Readiness checks of a local stack's processes (`stack.py`): ports, HTTP, gRPC health."""

from __future__ import annotations

import socket
import ssl

import httpx


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def grpc_ready(port: int) -> bool:
    """The picker's gRPC health says `readiness` SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1.0)
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def trust_only(cert_file: str) -> ssl.SSLContext:
    """A client context trusting the certificate(s) in `cert_file` alone, whatever names they
    carry: `sluice up` checks its own gateway at the address it listens on."""
    try:
        ctx = ssl.create_default_context(cafile=cert_file)
    except ssl.SSLError as err:
        raise RuntimeError(f"TLS: {cert_file} holds no PEM certificate ({err})") from err
    ctx.check_hostname = False
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # (a CA-issued leaf, trusted as is)
    return ctx


def has_pods(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    """The gateway answers /health (no key needed) and its picker knows a ready pod."""
    try:
        r = httpx.get(url + "/health", timeout=1.0, verify=verify)
        return r.status_code == 200 and bool(r.json()["pods"])
    except (httpx.HTTPError, ValueError, KeyError):
        return False