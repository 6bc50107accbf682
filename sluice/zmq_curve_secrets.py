"""The chart's pre-install hook: CURVE keys for the KV-event sockets, as two Kubernetes Secrets,
and for the KV-transfer sockets of prefill/decode pools, one Secret per pools' namespace.

Helm's template functions cannot make a Curve25519 key pair (a public key is a scalar
multiplication, then Z85), so a hook Job runs `python -m sluice.zmq_curve_secrets` from the
picker's image before the release's pods start:

    --engines NS/NAME   the engines' Secret: their key pair, the picker's public key
                        (repeated: a copy in each pools' namespace)
    --picker NS/NAME    the picker's Secret: its key pair, the engines' public key

Each Secret holds exactly one side's files (`zmq_curve.ENGINE_FILES` / `PICKER_FILES`), mounted
as that side's `--kv-events-curve-dir`. All are made at once from one new pair and then kept:
a later run (every upgrade) changes nothing, but for copying the engines' Secret into a
namespace newly listed. A pair no longer whole (the picker's Secret without any engines' copy,
or the reverse, or copies that differ) fails the run, naming what to delete: new keys would
not match the ones running engines or pickers hold. Only names are printed, never keys.

    --kv-transfer NS/NAME   a pools' namespace's KV-transfer keys (repeated: one per
                            namespace): all four files, a pair of its own

A pool's prefill and decode engines live in one namespace, so each namespace's Secret is
independent: made from a new pair when missing, else kept (`ensure_transfer`). The operator
mounts each role only its half (`sluice.operator.render`): prefill engines (CURVE servers)
the server pair and the client's public key, decode engines (clients) the reverse.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
from dataclasses import dataclass
from typing import Any

from sluice.zmq_curve import ENGINE_FILES, PICKER_FILES, new_keys


@dataclass(frozen=True)
class SecretRef:
    namespace: str
    name: str

    @classmethod
    def parse(cls, text: str) -> SecretRef:
        namespace, sep, name = text.partition("/")
        if not (sep and namespace and name):
            raise argparse.ArgumentTypeError(f"{text!r} is not NAMESPACE/NAME")
        return cls(namespace, name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class BrokenPair(RuntimeError):
    """One of the two Secrets exists without the other."""


def _secret(ref: SecretRef, data: dict[str, str], labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "labels": dict(labels)},
            "data": data}


def render_secrets(keys: dict[str, bytes], engines: list[SecretRef], picker: SecretRef,
                   labels: dict[str, str]) -> list[dict[str, Any]]:
    """The engines' Secrets and the picker's for `keys` (`zmq_curve.new_keys()`): pure."""
    def data(files: tuple[str, ...]) -> dict[str, str]:
        return {f: base64.b64encode(keys[f]).decode() for f in files}

    return [*(_secret(ref, data(ENGINE_FILES), labels) for ref in engines),
            _secret(picker, data(PICKER_FILES), labels)]


async def _read(core: Any, ref: SecretRef) -> dict[str, str] | None:
    """The Secret's data, None when there is none."""
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        return (await core.read_namespaced_secret(ref.name, ref.namespace)).data or {}
    except ApiException as err:
        if err.status == 404:
            return None
        raise


async def ensure(core: Any, engines: list[SecretRef], picker: SecretRef,
                 labels: dict[str, str]) -> str:
    """Make the Secrets that are missing (`core`: kubernetes_asyncio's CoreV1Api): all from
    a new pair when none exists, else the engines' copies from the one that does. What was
    done, in words; BrokenPair when the pair is no longer whole."""
    found = {ref: await _read(core, ref) for ref in engines}
    have = {ref: data for ref, data in found.items() if data is not None}
    missing = [ref for ref in engines if found[ref] is None]
    spare = SecretRef(picker.namespace, engines[0].name)
    # pools moved out of the release namespace: the copy left there is the source
    if not have and spare not in found and (data := await _read(core, spare)) is not None:
        have = {spare: data}
    picker_found = await _read(core, picker) is not None
    if not have and not picker_found:
        for body in render_secrets(new_keys(), engines, picker, labels):
            await core.create_namespaced_secret(body["metadata"]["namespace"], body)
        return "created"
    why = ("the picker's Secret is missing" if not picker_found
           else "every engines' Secret is missing" if not have
           else "the engines' Secrets differ" if len({tuple(sorted(d.items()))
                                                     for d in have.values()}) > 1 else "")
    if why:
        found_refs = ", ".join(str(r) for r in [*have, *([picker] if picker_found else [])])
        raise BrokenPair(f"the KV-event key pair is broken: {why}. Delete {found_refs} to "
                         "make a new pair, then restart the engines and the picker")
    data = next(iter(have.values()))
    for ref in missing:
        await core.create_namespaced_secret(ref.namespace, _secret(ref, dict(data), labels))
    return f"kept, copied to {', '.join(map(str, missing))}" if missing else "kept"


ALL_FILES = ENGINE_FILES + PICKER_FILES


async def ensure_transfer(core: Any, refs: list[SecretRef], labels: dict[str, str]) -> str:
    """Make each missing KV-transfer Secret from a new key pair (all four files), keep each
    one found; what was done, in words. BrokenPair names one found without every file."""
    made, kept = [], []
    for ref in refs:
        data = await _read(core, ref)
        if data is None:
            keys = new_keys()
            await core.create_namespaced_secret(ref.namespace, _secret(ref, {
                f: base64.b64encode(keys[f]).decode() for f in ALL_FILES}, labels))
            made.append(str(ref))
        elif missing := sorted(set(ALL_FILES) - set(data)):
            raise BrokenPair(f"the KV-transfer keys {ref} lack {', '.join(missing)}. Delete "
                             f"{ref} to make a new pair, then restart that namespace's "
                             "prefill and decode engines")
        else:
            kept.append(str(ref))
    return "; ".join(([f"created {', '.join(made)}"] if made else [])
                     + ([f"kept {', '.join(kept)}"] if kept else []))


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not (sep and key):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sluice.zmq_curve_secrets",
                                description="Make the KV-event sockets' CURVE key Secrets "
                                            "unless they exist.")
    p.add_argument("--engines", type=SecretRef.parse, action="append", default=[],
                   metavar="NS/NAME", help="the engines' Secret (repeat: one per namespace)")
    p.add_argument("--picker", type=SecretRef.parse, default=None, metavar="NS/NAME")
    p.add_argument("--kv-transfer", type=SecretRef.parse, action="append", default=[],
                   metavar="NS/NAME", help="a namespace's KV-transfer keys (repeat)")
    p.add_argument("--label", type=_label, action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if bool(args.engines) != bool(args.picker):
        p.error("--engines and --picker go together")
    if not (args.engines or args.kv_transfer):
        p.error("nothing to make: give --engines and --picker, or --kv-transfer")
    return args


async def _main(args: argparse.Namespace) -> None:
    from kubernetes_asyncio import client

    from sluice import kube_config

    async with client.ApiClient(await kube_config.load()) as api:
        core = client.CoreV1Api(api)
        if args.engines:
            what = await ensure(core, args.engines, args.picker, dict(args.label))
            names = ", ".join(str(r) for r in [*args.engines, args.picker])
            print(f"sluice: KV-event CURVE keys {what} ({names})")
        if args.kv_transfer:
            what = await ensure_transfer(core, args.kv_transfer, dict(args.label))
            print(f"sluice: KV-transfer CURVE keys: {what}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(_main(args))
    except BrokenPair as err:
        print(f"sluice: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
