"""Server-side `Table` rendering (what `kubectl get` asks for) from a CRD's
additionalPrinterColumns, with the small JSONPath subset printer columns use."""

from __future__ import annotations

import datetime
import re
from typing import Any

_FILTER = re.compile(r"^(\w+)\[\?\(@\.(\w+)==\"([^\"]*)\"\)\]$")


def json_path(obj: Any, path: str) -> Any:
    """`.a.b`, `.a[0]` and `.a[?(@.k=="v")].b`."""
    for part in re.split(r"\.(?![^\[]*\])", path.strip(".")):
        m = _FILTER.match(part)
        if m:
            items = (obj or {}).get(m.group(1)) or []
            obj = next((i for i in items if str(i.get(m.group(2))) == m.group(3)), None)
            continue
        m = re.match(r"^(\w+)\[(\d+)\]$", part)
        if m:
            items = (obj or {}).get(m.group(1)) or []
            obj = items[int(m.group(2))] if len(items) > int(m.group(2)) else None
            continue
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    then = datetime.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


def render_table(columns: list[dict[str, Any]] | None, items: list[dict[str, Any]]) -> dict:
    columns = columns or []
    defs = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
             "description": "name"}]
    defs += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""),
              "priority": c.get("priority", 0), "description": c.get("description", "")}
             for c in columns]
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        for c in columns:
            value = json_path(obj, c["jsonPath"])
            if c["type"] == "date":
                value = _age(value)
            cells.append(value)
        rows.append({"cells": cells, "object": {
            "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": obj["metadata"]}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {},
            "columnDefinitions": defs, "rows": rows}
