"""Workloads for `sluice bench serve` (seed-fixed).

Prompts are text: a part of N tokens is N words drawn from common English words
that BPE vocabularies hold as single tokens, so lengths are close to N tokens
(`usage.prompt_tokens` reports the exact counts).

- random: `num_prompts` completions of `input_len` tokens (x [1-r, 1+r]) and
  `output_len` output tokens.
- shared-prefix: G groups x U users; each request is a chat whose system prompt
  (S tokens) is shared by its group and whose question (Q tokens) is unique;
  output O tokens. Requests arrive in a seeded random order.
- multi-turn: `sessions` chats of `turns` turns; each turn appends the previous
  answer and a new Q-token question, so the conversation (the prefix) grows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number", "no", "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "oil", "its", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part"]


@dataclass
class Request:
    """One request; for multi-turn, `session`/`turn` place it in its conversation."""
    kind: str                         # "chat" | "completion"
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    group: int = -1
    session: int = -1
    turn: int = 0
    questions: list[str] = field(default_factory=list)  # multi-turn: one per turn
    model: str | None = None  # its own `model` (a LoRA adapter); None: the run's


class TextMaker:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self, n_tokens: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, n_tokens)))


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float,
                    maker: TextMaker) -> list[Request]:
    assert 0 <= range_ratio < 1
    out = []
    for _ in range(n):
        lo, hi = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
        out.append(Request("completion", output_len,
                           prompt=maker.text(maker.rng.randint(max(1, lo), max(1, hi)))))
    return out


def shared_prefix_workload(groups: int, users: int, system_len: int, question_len: int,
                           output_len: int, maker: TextMaker) -> list[Request]:
    systems = [maker.text(system_len) for _ in range(groups)]
    out = []
    for u in range(users):
        for g in range(groups):
            messages = [{"role": "system", "content": systems[g]},
                        {"role": "user", "content": maker.text(question_len)}]
            out.append(Request("chat", output_len, messages=messages, group=g))
    maker.rng.shuffle(out)
    return out


def multi_turn_workload(sessions: int, turns: int, system_len: int, question_len: int,
                        output_len: int, maker: TextMaker) -> list[Request]:
    """One Request per session (its turns are sent in order by the runner)."""
    out = []
    for s in range(sessions):
        system = maker.text(system_len)
        out.append(Request("chat", output_len, messages=[{"role": "system", "content": system}],
                           session=s, questions=[maker.text(question_len)
                                                 for _ in range(turns)]))
    return out


def ideal_hit_tokens(requests: list[Request], tokenizer: Any, block_size: int) -> tuple[int, int]:
    """(cacheable prompt tokens, total prompt tokens) with perfect routing and an
    unbounded cache: each prompt can reuse the full blocks of its longest common
    token prefix with any earlier prompt (single-turn workloads)."""
    seen: list[list[int]] = []
    hit = total = 0
    for r in requests:
        ids = (tokenizer.encode_chat(r.messages) if r.kind == "chat"
               else tokenizer.encode(r.prompt))
        best = 0
        for prev in seen[-512:]:
            n = 0
            for a, b in zip(prev, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        best = min(best, len(ids) - 1)  # the last prompt token is always computed
        hit += (best // block_size) * block_size
        total += len(ids)
        seen.append(ids)
    return hit, total
