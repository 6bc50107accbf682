"""Reading GIE's YAML values: field names checked, Go durations, Kubernetes quantities.

GIE decodes `flowControl:` and `saturationDetector:` with Go's JSON decoder into
`metav1.Duration` (a Go duration string: "200ms", "1m30s") and `resource.Quantity`
("100", "1k", "1Gi"; `Value()` rounds a fraction up). The same values read the same here.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                    "m": 60.0, "h": 3600.0}
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E"
                       r"|[eE][+-]?\d+)?")
_QUANTITY_SUFFIX = {"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"),
                    "m": Decimal("1e-3"), "k": Decimal("1e3"), "M": Decimal("1e6"),
                    "G": Decimal("1e9"), "T": Decimal("1e12"), "P": Decimal("1e15"),
                    "E": Decimal("1e18"), "Ki": Decimal(2**10), "Mi": Decimal(2**20),
                    "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
                    "Ei": Decimal(2**60)}


class ConfigError(ValueError):
    """A `flowControl:` or `saturationDetector:` value that GIE would refuse, or that
    Sluice does not know: named, with what is known."""


def check_fields(d: Any, known: tuple[str, ...], where: str) -> dict[str, Any]:
    """`d` as a dict whose keys are all in `known`; else a ValueError that names the
    unknown field and lists the known ones (a typo must not silently mean the default)."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    for name in d:
        if name not in known:
            raise ConfigError(f"{where}: unknown field {name!r}; known fields: "
                             + ", ".join(known))
    return d


def duration_s(value: Any, where: str) -> float:
    """A Go duration string ("200ms", "1m30s", "0") in seconds, as `metav1.Duration`
    reads it: a bare number is refused, since Go's decoder refuses it too."""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a duration string such as '200ms' or '30s', "
                         f"got {value!r}")
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    parts = _DURATION_PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ConfigError(f"{where}: {value!r} is not a duration (units: ns, us, ms, s, m, h)")
    return sign * sum(float(n) * _DURATION_UNIT_S[u] for n, u in parts)


def quantity(value: Any, where: str) -> int:
    """A Kubernetes quantity ("100", "1k", "500M", "1Gi", or a YAML number) as the
    integer `resource.Quantity.Value()` gives: a fraction rounds up."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{where}: expected a quantity such as 100, '1k' or '1Gi', "
                         f"got {value!r}")
    m = _QUANTITY.fullmatch(str(value).strip())
    if m is None:
        raise ConfigError(f"{where}: {value!r} is not a Kubernetes quantity")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    scale = (Decimal(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E")
             else _QUANTITY_SUFFIX[suffix])
    got = math.ceil(number * scale)
    if got < 0:
        raise ConfigError(f"{where}: must be non-negative, got {value!r}")
    return got
