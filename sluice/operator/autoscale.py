"""Pure autoscaling decision: (policy, current replicas, load sample, history, now) → Decision.

Like the HorizontalPodAutoscaler, with inference signals, each role on its own
bottleneck's (`SIGNALS`):
- the raw recommendation is `ceil(current × ratio)`, held at `current` when the ratio
  is within ±10 % (tolerance), clamped to [min, max], where ratio is
  - `serve` (aggregated engines): max(kv / targetKV, queue / targetQueue);
  - `prefill`: queue / targetQueue only. Prefill is compute-bound and holds KV blocks
    only until the decode engine pulls them, so its KV usage says little; requests
    waiting for a prefill slot are its backlog;
  - `decode`: kv / targetKV only. Decode is memory-bound: its capacity is the KV cache
    the running streams fill (prompts arrive prefilled, so its queue stays short until
    the cache is full);
- stabilization: a scale-up goes only to the *lowest* recommendation seen during the
  scale-up window, a scale-down only to the *highest* seen during the scale-down
  window, and only once the history covers the whole window (after a restart the
  autoscaler first watches for a window), so one spike or one idle sample never
  moves the pool;
- no sample (no ready engine reported) → hold, except to bring `current` into
  [min, max].
The history of recommendations is returned, not kept: the caller stores it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sluice.operator.spec import DECODE, PREFILL, SERVE, AutoscalingSpec

TOLERANCE = 0.1
KV, QUEUE = "kv", "queue"
SIGNALS = {SERVE: (KV, QUEUE), PREFILL: (QUEUE,), DECODE: (KV,)}  # what scales each role


@dataclass(frozen=True)
class LoadSample:
    kv_cache_usage: float  # mean of vllm:kv_cache_usage_perc over ready engines (0–1)
    queue_depth: float  # mean vllm:num_requests_waiting per ready engine
    engines: int  # how many engines reported


@dataclass(frozen=True)
class Recommendation:
    at: float  # seconds (monotonic or epoch, the caller's clock)
    replicas: int


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str  # CamelCase, used as the Event reason: ScaledUp, ScaledDown, ...
    message: str
    history: tuple[Recommendation, ...]

    def changes(self, current: int) -> bool:
        return self.replicas != current


def raw_recommendation(policy: AutoscalingSpec, current: int, sample: LoadSample,
                       role: str = SERVE) -> tuple[int, str]:
    """(wanted replicas, the signals it followed, in words) for `role`'s `SIGNALS`."""
    ratios = {KV: sample.kv_cache_usage / policy.target_kv_cache_usage,
              QUEUE: sample.queue_depth / policy.target_queue_depth}
    words = {KV: f"KV cache usage {sample.kv_cache_usage:.2f} (target "
                 f"{policy.target_kv_cache_usage:.2f})",
             QUEUE: f"queue depth {sample.queue_depth:.1f} (target "
                    f"{policy.target_queue_depth})"}
    used = SIGNALS[role]
    ratio = max(ratios[s] for s in used)
    signal = ", ".join(words[s] for s in used)
    base = max(current, 1)
    if abs(ratio - 1.0) <= TOLERANCE:
        wanted = current
    else:
        wanted = math.ceil(base * ratio - 1e-9)
    return _clamp(policy, wanted), signal


def _clamp(policy: AutoscalingSpec, n: int) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, n))


def _prune(history: tuple[Recommendation, ...], now: float,
           keep_s: float) -> tuple[Recommendation, ...]:
    """Records of the last `keep_s` seconds, plus the newest older one (it proves coverage)."""
    recent = tuple(r for r in history if now - r.at <= keep_s)
    older = [r for r in history if now - r.at > keep_s]
    return (older[-1],) + recent if older else recent


def _window(history: tuple[Recommendation, ...], now: float, seconds: int) -> list[int] | None:
    """Recommendations of the last `seconds`, or None if the history is shorter than that."""
    if seconds > 0 and not any(now - r.at >= seconds for r in history):
        return None
    return [r.replicas for r in history if now - r.at <= seconds]


def decide(policy: AutoscalingSpec, current: int, sample: LoadSample | None,
           history: tuple[Recommendation, ...], now: float, role: str = SERVE) -> Decision:
    window = max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    history = _prune(history, now, window)
    if sample is None or sample.engines == 0:
        target = _clamp(policy, current)
        reason = "OutOfBounds" if target != current else "NoMetrics"
        return Decision(target, reason,
                        f"no load sample; keeping {target} replicas within "
                        f"[{policy.min_replicas}, {policy.max_replicas}]", history)
    wanted, signal = raw_recommendation(policy, current, sample, role)
    history = history + (Recommendation(now, wanted),)
    if wanted > current:
        recent = _window(history, now, policy.scale_up_stabilization_s)
        target = max(current, min(recent)) if recent else current
        if target > current:
            return Decision(target, "ScaledUp", f"{signal}: {current} → {target} replicas",
                            history)
        return Decision(current, "StabilizingUp", f"{signal}: wants {wanted}, holding "
                        f"{current} for the {policy.scale_up_stabilization_s}s scale-up window",
                        history)
    if wanted < current:
        recent = _window(history, now, policy.scale_down_stabilization_s)
        target = min(current, max(recent)) if recent else current
        if target < current:
            return Decision(target, "ScaledDown", f"{signal}: {current} → {target} replicas",
                            history)
        return Decision(current, "StabilizingDown", f"{signal}: wants {wanted}, holding "
                        f"{current} for the {policy.scale_down_stabilization_s}s scale-down "
                        "window", history)
    if current != _clamp(policy, current):
        target = _clamp(policy, current)
        return Decision(target, "OutOfBounds", f"{current} replicas outside "
                        f"[{policy.min_replicas}, {policy.max_replicas}] → {target}", history)
    return Decision(current, "Steady", f"{signal}: steady at {current}", history)
