"""A pool's LoRA adapters on its running engines, through their runtime LoRA endpoints
(vLLM's, which the sluice engine speaks too): `GET /v1/models`, `POST
/v1/load_lora_adapter {lora_name, lora_path}`, `POST /v1/unload_lora_adapter {lora_name}`.

Policy, one `LoraSyncer.sync` per reconcile pass, after the children are applied:

- The pod template carries LoRA's flags and limits only (`engine_args.lora_args`), never
  the adapter list, so a changed `spec.loras` restarts no engine. (A pvc adapter on a claim
  the pods do not mount yet is the exception: mounting it is a rolling update,
  `render_lora`.)
- Every ready engine pod (Ready, with an IP, not terminating), of every role, is read:
  its adapters are the `/v1/models` entries with a `parent`. An adapter it lists that the
  spec does not, or whose `root` is not the path the spec names now, is unloaded (404:
  gone already); one the spec lists that it does not is loaded. The operator owns the
  list: an adapter loaded by hand, or by `--lora-modules` in `engine.args`, is unloaded.
- An adapter's path is read from the pod itself: a pvc adapter's folder is where that
  pod mounts the claim. A pod that does not mount it (its template predates the claim,
  a rollout is under way) is left alone for that adapter: not loaded, not counted, no
  problem; the new pods get it.
- A new engine starts with the base model only; its Ready event triggers the pass that
  loads the adapters, so it serves them one pass later (until then it is not counted).
- Engines are handled concurrently; one engine's requests in turn, and none more this pass
  once it leaves one unanswered (a timeout, a lost connection), rather than wait out the
  timeout of each. A load answered with anything but 2xx, or not at all, is a
  `LoraLoadFailed` problem naming the adapter, the
  pod and the engine's answer: the pool goes Degraded with a Warning Event, and the next
  pass (any trigger; the resync at the latest) tries again. Likewise `LoraUnloadFailed`;
  an engine whose `/v1/models` fails is `LoraListFailed`, and counts for no adapter.
- `status.loras[].readyReplicas`: ready engines that list the adapter after the pass
  (a load answered 2xx counts; the next pass's listing checks it).
- Every request carries the engine key (`Authorization: Bearer`), as the picker's do.
"""

from __future__ import annotations

import asyncio
import posixpath
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice.labels import HTTP_PORT
from sluice.operator.observe import Problem
from sluice.operator.sources import HuggingFaceSource, ImageSource, LoraAdapter, PvcSource
from sluice.operator.spec import PoolSpec

LIST_TIMEOUT_S = 5.0
# A load answers once the adapter is in the engine: a Hub adapter downloads first (tens of
# MB for a rank-16 adapter of an 8B model), and the pass waits for it.
LOAD_TIMEOUT_S = 60.0


@dataclass
class LoraReport:
    status: list[dict[str, Any]]  # status.loras, in spec order
    problems: list[Problem] = field(default_factory=list)
    loaded: Counter[str] = field(default_factory=Counter)  # adapter -> engines, this pass
    unloaded: Counter[str] = field(default_factory=Counter)


@dataclass
class _Engine:
    """One engine's outcome: what it serves after the pass, and what went wrong."""

    serving: set[str] = field(default_factory=set)
    failures: dict[str, tuple[str, str]] = field(default_factory=dict)  # adapter -> problem
    loaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)


def ready_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def ready(pod: dict[str, Any]) -> bool:
        status = pod.get("status") or {}
        return bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp") and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or ())
    return sorted((p for p in pods if ready(p)), key=lambda p: p["metadata"]["name"])


def _claim_dir(pod: dict[str, Any], claim: str) -> str | None:
    """Where the pod's engine container mounts `claim`; None: it does not."""
    spec = pod.get("spec") or {}
    names = {v["name"] for v in spec.get("volumes") or ()
             if (v.get("persistentVolumeClaim") or {}).get("claimName") == claim}
    engine = next(iter(spec.get("containers") or ()), {})
    return next((m["mountPath"] for m in engine.get("volumeMounts") or ()
                 if m.get("name") in names), None)


def adapter_path(adapter: LoraAdapter, pod: dict[str, Any]) -> str | None:
    """The `lora_path` to load `adapter` in `pod`; None: the pod cannot reach its files."""
    src = adapter.source
    if isinstance(src, HuggingFaceSource):
        return src.repo  # not a folder: the engine downloads it from the Hub, as vLLM does
    if isinstance(src, ImageSource):
        return src.path
    assert isinstance(src, PvcSource)
    root = _claim_dir(pod, src.claim_name)
    return None if root is None else (posixpath.join(root, src.path) if src.path else root)


def listed_adapters(models: Any) -> dict[str, str | None]:
    """Adapter name -> root, from a `/v1/models` answer (the base model has no parent)."""
    data = models.get("data") if isinstance(models, dict) else None
    return {m["id"]: m.get("root") for m in data or () if isinstance(m, dict)
            and m.get("parent") and isinstance(m.get("id"), str)}


def same_files(root: str | None, path: str) -> bool:
    """Whether an engine's `root` for an adapter is the `lora_path` the spec names. vLLM
    reports the path as it was given; an engine may report where it downloaded a Hub
    repository instead, a folder of Hugging Face's cache (`.../models--org--name/...`)."""
    if root is None or root == path:
        return True
    hub_folder = "models--" + path.replace("/", "--")
    return not path.startswith("/") and root.startswith("/") and hub_folder in root.split("/")


def plan(desired: dict[str, str | None], listed: dict[str, str | None]
         ) -> tuple[list[str], list[str]]:
    """(unload, load) for one engine. `desired`: name -> path (None: not reachable from this
    engine: left as it is); `listed`: name -> root as the engine reports it (None: unknown)."""
    stale = {n for n, root in listed.items() if n in desired and desired[n] is not None
             and not same_files(root, desired[n])}
    unload = sorted({n for n in listed if n not in desired} | stale)
    load = sorted(n for n, path in desired.items()
                  if path is not None and (n not in listed or n in stale))
    return unload, load


def _answer(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    error = body.get("error") if isinstance(body, dict) else None
    message = (error.get("message") if isinstance(error, dict) else None) or (
        body.get("message") or body.get("detail") if isinstance(body, dict) else None)
    return f"HTTP {response.status_code}: {str(message or body)[:200]}"


class LoraSyncer:
    """Loads and unloads adapters; one per operator, sharing its HTTP client."""

    def __init__(self, http: httpx.AsyncClient, api_key: str | None = None,
                 list_timeout_s: float = LIST_TIMEOUT_S, load_timeout_s: float = LOAD_TIMEOUT_S):
        self.http, self.list_timeout_s, self.load_timeout_s = http, list_timeout_s, load_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def sync(self, pool: PoolSpec, pods: list[dict[str, Any]]) -> LoraReport | None:
        """None: the pool's engines run without LoRA (nothing to read or report)."""
        if pool.lora is None:
            return None
        ready = ready_pods(pods)
        engines = await asyncio.gather(*(self._engine(pool, pod) for pod in ready))
        report = LoraReport(status=[
            {"name": a.name, "readyReplicas": sum(a.name in e.serving for e in engines)}
            for a in pool.loras])
        failed: dict[tuple[str, str], list[str]] = {}  # (reason, adapter) -> messages
        for pod, engine in zip(ready, engines):
            report.loaded.update(engine.loaded)
            report.unloaded.update(engine.unloaded)
            for name, (reason, message) in engine.failures.items():
                failed.setdefault((reason, name), []).append(
                    f"pod {pod['metadata']['name']}: {message}")
        for (reason, _), messages in sorted(failed.items()):
            more = f" (and {len(messages) - 1} more engines)" if len(messages) > 1 else ""
            report.problems.append((reason, messages[0] + more))
        return report

    async def _engine(self, pool: PoolSpec, pod: dict[str, Any]) -> _Engine:
        ip = pod["status"]["podIP"]
        url = f"http://{f'[{ip}]' if ':' in ip else ip}:{HTTP_PORT}"  # (an IPv6 pod too)
        out = _Engine()
        try:
            response = await self.http.get(f"{url}/v1/models", headers=self._headers,
                                           timeout=self.list_timeout_s)
            listed = listed_adapters(response.json()) if response.is_success else None
            error = None if response.is_success else _answer(response)
        except (httpx.HTTPError, OSError, ValueError) as e:  # (ValueError: not JSON)
            listed, error = None, _unanswered(e)
        if listed is None:
            out.failures = {"": ("LoraListFailed", f"GET /v1/models failed: {error}")}
            return out
        desired = {a.name: adapter_path(a, pod) for a in pool.loras}
        unload, load = plan(desired, listed)
        out.serving = {n for n in listed if n in desired and n not in unload}
        steps = [("unload", n, {"lora_name": n}) for n in unload] + [
            ("load", n, {"lora_name": n, "lora_path": desired[n]}) for n in load]
        for verb, name, body in steps:
            if name in out.failures:  # its unload failed: no load on top
                continue
            try:
                response = await self.http.post(f"{url}/v1/{verb}_lora_adapter", json=body,
                                                headers=self._headers,
                                                timeout=self.load_timeout_s)
            except (httpx.HTTPError, OSError) as e:
                # An engine that stopped answering would time out on every request left:
                # the next pass asks it again instead of this one waiting for each.
                out.failures[name] = _failure(verb, body, _unanswered(e))
                break
            if response.is_success or (verb == "unload" and response.status_code == 404):
                (out.loaded if verb == "load" else out.unloaded).append(name)
                if verb == "load":
                    out.serving.add(name)
            else:
                out.failures[name] = _failure(verb, body, _answer(response))
        return out


def _unanswered(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__  # (a timeout: no text)


def _failure(verb: str, body: dict[str, Any], error: str) -> tuple[str, str]:
    name = body["lora_name"]
    if verb == "unload":
        return "LoraUnloadFailed", f"adapter {name} not unloaded: {error}"
    return "LoraLoadFailed", f"adapter {name} not loaded from {body['lora_path']}: {error}"
