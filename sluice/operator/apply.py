"""Apply desired children idempotently: create what is missing, re-apply what drifted,
delete what is no longer desired. Never touches objects the pool does not own.

Contract of `apply_child`: after it returns, the live object's spec, labels and
ownerReferences hold the desired values (up to server-side defaults). Writes are
server-side applies under the operator's field manager, forced: the operator is the
authority on the fields it renders, and a field it stops rendering is removed, while
fields only other managers set (a label someone added) are kept. A
child edited by hand (drift) differs from the desired object and is applied again; a
child deleted by hand is recreated. The ownership check reads first: an object of the
same name that this pool does not control is reported, never taken over.

A write the API server refuses for good (422 invalid, 403 quota or admission, 400) is
not raised: `apply_all` reports it as a `ChildRejected` problem carrying the server's
message, goes on with the other children, and the pool becomes Degraded with an Event.
Transient errors (`kube.is_transient`) are raised, for the caller to retry with backoff.

`AppliedMemo` remembers, per child, what the API server returned after our last write
(uid, spec generation — resourceVersion for kinds without one — and our spec hash). A
child whose marker still matches was not edited since, so it is left alone even if the
server normalised a field (`cpu: 1000m` → `1`) and no longer looks like a superset of
the desired object: that would otherwise be a replace on every pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice import labels
from sluice.operator import kube
from sluice.operator.render import Manifest

OWNED_KINDS = (kube.DEPLOYMENTS, kube.PDBS, kube.SERVICES)


AppliedMemo = dict[tuple[str, str, str], tuple[str, str, str]]  # (kind, ns, name) -> marker


def _marker(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    version = meta.get("generation") or f"rv{meta.get('resourceVersion')}"  # spec version
    return (str(meta.get("uid")), str(version),
            str((meta.get("annotations") or {}).get(labels.SPEC_HASH_ANNOTATION)))


class NotOwned(Exception):
    """A child's name is taken by an object that this pool does not control."""


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)
    live: dict[str, dict[str, Any]] = field(default_factory=dict)  # "Kind/name" -> object

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted)


def is_subset(desired: Any, live: Any) -> bool:
    """Every field we set has the value we set; extra live fields (server defaults) are fine.
    Lists must have the same length (an added container or env var is drift)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(desired) == len(live)
                and all(is_subset(d, x) for d, x in zip(desired, live)))
    return desired == live


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in obj.get("metadata", {}).get("ownerReferences") or ())


def needs_update(desired: Manifest, live: dict[str, Any], spec_unchanged: bool = False) -> bool:
    """`spec_unchanged`: the live spec is known to be what we last wrote (memo marker)."""
    dm, lm = desired["metadata"], live.get("metadata", {})
    return not ((spec_unchanged or is_subset(desired["spec"], live.get("spec")))
                and is_subset(dm["labels"], lm.get("labels") or {})
                and is_subset(dm["annotations"], lm.get("annotations") or {})
                and is_subset(dm["ownerReferences"], lm.get("ownerReferences") or []))


async def apply_child(client: kube.KubeClient, desired: Manifest, owner_uid: str,
                      memo: AppliedMemo | None = None) -> tuple[str, dict[str, Any]]:
    """Make one child match `desired`; returns ("created" | "updated" | "unchanged", the
    object as the API server last returned it). `memo` is updated with its marker."""
    ref = kube.BY_KIND[desired["kind"]]
    ns, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    key = (desired["kind"], ns, name)
    memo = {} if memo is None else memo
    want_hash = desired["metadata"]["annotations"][labels.SPEC_HASH_ANNOTATION]
    try:
        live: dict[str, Any] | None = await client.get(ref, ns, name)
    except kube.NotFound:
        live = None
    if live is not None:
        if not owned_by(live, owner_uid):
            raise NotOwned(f"{desired['kind']} {ns}/{name} exists and is not owned by this pool")
        marker = _marker(live)
        if not needs_update(desired, live, memo.get(key) == marker and marker[2] == want_hash):
            memo[key] = marker
            return "unchanged", live
    applied = await client.apply(ref, ns, desired)
    memo[key] = _marker(applied)
    return ("created" if live is None else "updated"), applied


async def prune(client: kube.KubeClient, namespace: str, pool: str, owner_uid: str,
                keep: set[tuple[str, str]]) -> list[str]:
    """Delete owned children of `pool` whose (kind, name) is not in `keep`."""
    deleted = []
    for ref in OWNED_KINDS:
        for obj in await client.list(ref, namespace, labels.pool_selector(pool)):
            kind, name = _kind_of(ref), obj["metadata"]["name"]
            if (kind, name) not in keep and owned_by(obj, owner_uid):
                await client.delete(ref, namespace, name)
                deleted.append(f"{kind}/{name}")
    return deleted


def rejection(manifest: Manifest, error: kube.ApiError, verb: str) -> tuple[str, str]:
    """The Degraded problem for a child the API server refused (its message verbatim)."""
    meta = manifest["metadata"]
    message = (f"{manifest['kind']} {meta['namespace']}/{meta['name']} not {verb}: "
               f"{error.status} {error.reason}: {error.message}")
    return ("ChildRejected", message)


def _kind_of(ref: kube.ResourceRef) -> str:
    return next(kind for kind, r in kube.BY_KIND.items() if r == ref)


async def apply_all(client: kube.KubeClient, desired: list[Manifest], owner_uid: str,
                    prune_orphans: bool = True, memo: AppliedMemo | None = None
                    ) -> ApplyReport:
    """Apply every child, then (if asked) prune the ones no longer rendered
    (e.g. a `serve` Deployment after the pool switched to prefill/decode roles)."""
    report = ApplyReport()
    for manifest in desired:
        try:
            action, live = await apply_child(client, manifest, owner_uid, memo)
        except NotOwned as e:
            report.problems.append(("ChildNotOwned", str(e)))
            continue
        except kube.ApiError as e:
            if kube.is_transient(e):
                raise
            report.problems.append(rejection(manifest, e, "applied"))
            continue
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        getattr(report, action).append(name)
        report.live[name] = live
    if desired and prune_orphans:
        ns = desired[0]["metadata"]["namespace"]
        pool = desired[0]["metadata"]["labels"][labels.POOL]
        keep = {(m["kind"], m["metadata"]["name"]) for m in desired}
        try:
            report.deleted = await prune(client, ns, pool, owner_uid, keep)
        except kube.ApiError as e:
            if kube.is_transient(e):
                raise
            message = (f"a child no longer desired was not deleted: "
                       f"{e.status} {e.reason}: {e.message}")
            report.problems.append(("PruneRejected", message))
    return report
