"""Disaggregated prefill/decode in the API process (the engine half is kv_transfer/).

`DisaggLegs.prepare` turns a request's `kv_transfer_params` into the engine's
KVTransferParams, refusing with a 400 what this engine cannot do: no
--kv-transfer-config, the wrong kv_role, several prompts or n > 1, a streamed prefill
leg, prompt logprobs on a decode leg, or remote_block_ids that do not fit the prompt
(params of another prompt, or of an engine with another block size). A prefill leg
(`do_remote_decode`) runs with max_tokens 1 and no min_tokens, as vLLM's proxy sends it.

llm-d's contract: a request to a consumer engine with the header
`x-prefiller-host-port: host:port` (and no kv_transfer_params) first runs its prefill
leg on that engine over HTTP (the same path and body, with `do_remote_decode`,
max_tokens 1, stream false, the caller's Authorization), then decodes here with the
params the answer returned. If that leg fails (engine unreachable, an error answer, no
params), the request prefills here: it completes, and the failure is counted in
`sluice:kv_transfer_prefill_leg_failures_total`. A pull that fails later is the engine
core's fallback (`sluice:kv_transfer_fallbacks_total`).
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, generate_latest

from sluice.engine.kv_transfer.params import KVTransferParams
from sluice.engine.server.errors import RequestError
from sluice.engine.server.priority import PRIORITY_HEADER

log = logging.getLogger("sluice.engine")

PREFILLER_HEADER = "x-prefiller-host-port"
# The prefill leg waits in the prefill engine's queue like any request: a long read
# timeout; an engine that is gone fails at connect.
PREFILL_LEG_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
_PREFILL_LEG_FIELDS = {"do_remote_decode": True, "do_remote_prefill": False,
                       "remote_engine_id": None, "remote_block_ids": None,
                       "remote_host": None, "remote_port": None}


class DisaggLegs:
    """Per app. State: an httpx.AsyncClient made on first use (the event loop's) and a
    Prometheus registry for the prefill-leg failures (both touched on the loop only)."""

    def __init__(self, kv_role: str | None, block_size: int, model_name: str):
        self.kv_role, self.block_size, self.model_name = kv_role, block_size, model_name
        self.registry = CollectorRegistry()
        self.failures = Counter("sluice:kv_transfer_prefill_leg_failures", "Prefill legs "
                                f"({PREFILLER_HEADER}) that failed: the request prefilled "
                                "locally", ["model_name"],
                                registry=self.registry).labels(model_name)
        self._http: httpx.AsyncClient | None = None

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry) if self.kv_role else b""

    async def prepare(self, raw: Request, body: Any, prompts: list[list[int]],
                      derived: dict[str, Any]) -> dict[str, Any]:
        """`derived` with kv_transfer_params (and the prefill leg's max_tokens) set."""
        field = body.kv_transfer_params
        header = raw.headers.get(PREFILLER_HEADER)
        if (field is None and header and self.kv_role in ("kv_consumer", "kv_both")
                and len(prompts) == 1 and body.n == 1):
            leg = await self._prefill_leg(raw, header)
            try:
                params = None if leg is None else self._check(leg, body, prompts, derived)
            except RequestError as exc:
                log.warning("prefill leg on %s returned unusable params: prefilling here "
                            "(%s)", header, exc)
                params = None
            if params is None or not params.do_remote_prefill:
                self.failures.inc()
                return derived
        elif field is None:
            return derived
        else:
            params = self._check(field, body, prompts, derived)
            if params is None:
                return derived
        out = {**derived, "kv_transfer_params": params}
        if params.do_remote_decode:
            out.update(max_tokens=1, min_tokens=0)
        return out

    def _check(self, field: Any, body: Any, prompts: list[list[int]],
               derived: dict[str, Any]) -> KVTransferParams | None:
        raw = field if isinstance(field, dict) else field.model_dump()
        if not (raw.get("do_remote_decode") or raw.get("do_remote_prefill")):
            return None  # asks for nothing (vLLM's proxies may send it to any engine)
        if self.kv_role is None:
            raise RequestError("kv_transfer_params need an engine started with "
                               "--kv-transfer-config", "kv_transfer_params")
        try:
            params = KVTransferParams(**{**raw, "tp_size": raw.get("tp_size") or 1,
                                         "remote_block_ids": _ids(raw)})
        except (TypeError, ValueError) as exc:
            raise RequestError(str(exc), "kv_transfer_params") from None
        where = "kv_transfer_params"
        if params.do_remote_decode and self.kv_role == "kv_consumer":
            raise RequestError("do_remote_decode: this engine is a kv_consumer (it decodes; "
                               "it does not prefill for others)", where)
        if params.do_remote_prefill and self.kv_role == "kv_producer":
            raise RequestError("do_remote_prefill: this engine is a kv_producer (it "
                               "prefills for others; it does not pull)", where)
        if len(prompts) != 1 or body.n != 1:
            raise RequestError("kv_transfer_params need one prompt and n = 1", where)
        if params.do_remote_decode and body.stream:
            raise RequestError("a prefill leg (do_remote_decode) answers with stream: false",
                               "stream")
        if params.do_remote_prefill:
            adapter = body.model if body.model not in (None, self.model_name) else None
            if params.lora_name != adapter:
                raise RequestError(
                    f"kv_transfer_params.lora_name {params.lora_name!r}: the prefill ran with "
                    f"another adapter than this request's ({adapter!r})",
                    "kv_transfer_params.lora_name")
            if derived.get("prompt_logprobs", body.prompt_logprobs) is not None:
                raise RequestError("prompt_logprobs need every prompt token's logits: not "
                                   "with do_remote_prefill", "prompt_logprobs")
            n, bs = len(prompts[0]), self.block_size
            want = -(-n // bs)
            if len(params.remote_block_ids or ()) != want:
                raise RequestError(
                    f"kv_transfer_params.remote_block_ids names {len(params.remote_block_ids)}"
                    f" blocks; this prompt of {n} tokens fills {want} blocks of {bs} tokens "
                    f"(params of another prompt, or of an engine with another block size)",
                    "kv_transfer_params.remote_block_ids")
        return params

    async def _prefill_leg(self, raw: Request, header: str) -> dict | None:
        """Run the prefill leg on `header`'s engine; its kv_transfer_params, or None."""
        host, sep, port = header.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RequestError(f"{PREFILLER_HEADER} must be host:port, got {header!r}",
                               PREFILLER_HEADER)
        payload = dict(await raw.json())
        for key in ("min_tokens", "stream_options", "max_completion_tokens"):
            payload.pop(key, None)
        payload.update(stream=False, max_tokens=1, kv_transfer_params=_PREFILL_LEG_FIELDS)
        headers = {k: v for k, v in raw.headers.items()
                   if k.lower() in ("authorization", "x-request-id", PRIORITY_HEADER)}
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=PREFILL_LEG_TIMEOUT)
        url = f"http://{host}:{port}{raw.url.path}"
        try:
            resp = await self._http.post(url, json=payload, headers=headers)
            params = resp.json().get("kv_transfer_params") if resp.status_code == 200 else None
            if params is None:
                log.warning("prefill leg on %s answered %d without kv_transfer_params: "
                            "prefilling here (%s)", header, resp.status_code, resp.text[:300])
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("prefill leg on %s failed: prefilling here (%r)", header, exc)
            params = None
        return params

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def _ids(raw: dict) -> tuple[int, ...] | None:
    ids = raw.get("remote_block_ids")
    return None if ids is None else tuple(ids)
