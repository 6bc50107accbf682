"""Compiles structured-output constraints with xgrammar, once per distinct constraint.

The server compiles a request's constraint on a worker thread before the request is
queued, so an invalid schema, regex or grammar is a 400 naming the problem, and the
compile time (milliseconds to a few hundred for large schemas) stays off the event
loop and off the engine thread. The engine thread then finds the compiled grammar in
the cache when it adds the request and builds the request's own matcher from it.

Thread safety: any thread may call `compile`; the cache and the in-flight table are
guarded by `_lock`, and a constraint being compiled by one thread is waited for, not
compiled again, by the others. xgrammar itself (it imports transformers: ~4 s) is
imported on the first constraint, so engines that never see one never pay for it.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

from sluice.engine.structured_output.grammar import RequestGrammar
from sluice.engine.structured_output.params import StructuredOutputsParams

log = logging.getLogger("sluice.engine")

MAX_CACHED_GRAMMARS = 512
# Whitespace xgrammar allows between JSON elements when any is allowed. Unbounded, a
# model can loop on newlines until max_tokens (reported against vLLM with small
# models); 32 characters still hold a newline and indentation 15 levels deep.
MAX_JSON_WHITESPACE = 32
# xgrammar's messages start with "[time] /path/file.cc:line: " and sometimes an
# internal "Check failed: (...) is false: "; the client gets what follows.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


class InvalidGrammarError(ValueError):
    """The constraint does not compile: the message names the problem (a 400)."""


class StructuredOutputManager:
    """Compiled grammars by constraint key (LRU, at most MAX_CACHED_GRAMMARS)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int],
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        """`vocab_size`: the model's logits width (the bitmask's); `tokenizer`: None for an
        engine that only takes token ids (it then refuses constraints)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_cached = max_cached
        self.num_compiled = 0  # compilations run (cache misses), for tests and metrics
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._compiler = None  # xgrammar GrammarCompiler, built on first use

    def grammar_for(self, params: StructuredOutputsParams | None) -> RequestGrammar | None:
        """A fresh matcher for one request (None without a constraint)."""
        if params is None:
            return None
        return RequestGrammar(self.compile(params))

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar for `params` (cached); InvalidGrammarError if it has none."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if owner:
                future = Future()
                self._cache[key] = future
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                future.set_result(self._compile(params))
            except BaseException as exc:  # noqa: BLE001 - waiters get it too; never cached
                with self._lock:
                    if self._cache.get(key) is future:
                        del self._cache[key]
                future.set_exception(exc)
        return future.result()

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind = params.kind
        self.num_compiled += 1
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    params.json, any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "json_object":  # vLLM's: an object, not any JSON value
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(params.choice_grammar())
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as exc:
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                    "choice": "choice", "grammar": "grammar"}[kind]
            raise InvalidGrammarError(f"invalid {what}: {_clean(exc)}") from exc

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise InvalidGrammarError(
                        "structured outputs need the model's tokenizer; this engine has none")
                self._compiler = _build_compiler(self.tokenizer, self.vocab_size,
                                                 self.stop_token_ids)
            return self._compiler


def _build_compiler(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """An xgrammar compiler for the tokenizer's vocabulary, padded to the model's logits."""
    import xgrammar as xgr

    backend = tokenizer.backend
    # The vocabulary type (byte-level, byte-fallback, raw) and prefix space, detected from
    # the tokenizers JSON as xgrammar's own from_huggingface does.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    encoded = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids or None,
                             add_prefix_space=meta["add_prefix_space"])
    log.info("structured outputs: xgrammar over a vocabulary of %d (%s)", vocab_size,
             meta["vocab_type"].name)
    # Our own LRU caches compiled grammars; xgrammar's cache would hold them a second time.
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _clean(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGR_PREFIX.sub("", text).strip()
