"""Pin the chart's three Sluice images to what the release workflow just pushed.

    python .github/scripts/pin_chart_images.py charts/sluice/values.yaml \\
        --registry ghcr.io/OWNER --version 1.2.3 --digests DIR

DIR holds one file per image, named after it (`sluice-engine`, `sluice-gateway`,
`sluice-operator`), each holding the `sha256:...` digest of its multi-platform index.
values.yaml is edited in place, line by line, so its comments (the chart's documentation)
survive; the result is then parsed and must equal the original with exactly these values
changed. A tag `VERSION@sha256:...` renders as `repo:VERSION@sha256:...`: the kubelet
pulls by the digest, and a reader still sees the version.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path

import yaml

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def pins(registry: str, version: str, digests: dict[str, str]) -> dict[tuple[str, ...], str]:
    """values.yaml path -> new value, for each image the chart names."""
    def tag(name: str) -> str:
        return f"{version}@{digests[name]}"

    return {
        ("operator", "image", "repository"): f"{registry}/sluice-operator",
        ("operator", "image", "tag"): tag("sluice-operator"),
        ("picker", "image", "repository"): f"{registry}/sluice-gateway",
        ("picker", "image", "tag"): tag("sluice-gateway"),
        ("operator", "engineImage"): f"{registry}/sluice-engine:{tag('sluice-engine')}",
    }


def set_scalar(text: str, path: tuple[str, ...], value: str) -> str:
    """`text` with the scalar at `path` (a mapping key on a line of its own, at each level
    the direct child of the one before) replaced by `value`, double-quoted."""
    lines = text.splitlines(keepends=True)
    depth, child_indent = 0, 0  # the indent of the keys of the current level
    for i, line in enumerate(lines):
        body = line.lstrip(" ")
        if not body.strip() or body.startswith("#"):
            continue
        indent = len(line) - len(body)
        if child_indent < 0:  # first line inside the block just entered
            child_indent = indent
        if indent < child_indent:
            break  # left the block of path[depth - 1] without finding path[depth]
        if indent != child_indent or not body.startswith(f"{path[depth]}:"):
            continue
        if depth == len(path) - 1:
            lines[i] = f"{' ' * indent}{path[depth]}: {json.dumps(value)}\n"
            return "".join(lines)
        depth, child_indent = depth + 1, -1
    raise KeyError(".".join(path))


def pin(text: str, changes: dict[tuple[str, ...], str]) -> str:
    new = text
    for path, value in changes.items():
        new = set_scalar(new, path, value)
    expected = copy.deepcopy(yaml.safe_load(text))
    for path, value in changes.items():
        node = expected
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    assert yaml.safe_load(new) == expected, "the line edits changed more than the pins"
    return new


def read_digests(folder: Path) -> dict[str, str]:
    digests = {}
    for name in ("sluice-engine", "sluice-gateway", "sluice-operator"):
        digest = (folder / name).read_text().strip()
        if not DIGEST.match(digest):
            raise SystemExit(f"{folder / name}: not a sha256 digest: {digest!r}")
        digests[name] = digest
    return digests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("values", type=Path)
    p.add_argument("--registry", required=True, help="e.g. ghcr.io/sluice-dev (lowercase)")
    p.add_argument("--version", required=True, help="the release, without its leading v")
    p.add_argument("--digests", type=Path, required=True)
    args = p.parse_args(argv)
    if args.registry != args.registry.lower() or args.version.startswith("v"):
        raise SystemExit("registry paths are lowercase; the version has no leading v")
    changes = pins(args.registry.rstrip("/"), args.version, read_digests(args.digests))
    args.values.write_text(pin(args.values.read_text(), changes))
    for path, value in changes.items():
        print(f"{'.'.join(path)} = {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
