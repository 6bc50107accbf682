"""The engine core's adapters: which are registered (served names), which are loaded in
host memory, and which sit in the batch slots the model's LoRA layers compute with.

Policy:
- Registered adapters (--lora-modules, /v1/load_lora_adapter) are what requests may name;
  each registration gets a new `lora_id`, which keys the loaded weights, the slots and the
  prefix cache, so a name loaded again from another path never reuses the old weights.
- Loaded (host memory) is an LRU of at most --max-cpu-loras adapters. A request whose
  adapter is not loaded waits in the queue while a background thread reads it
  (`ready`), so a step never waits for a file; other requests go on. Once a load lands,
  the least recently used adapter that no running request needs is dropped. Adapters of
  running requests are never dropped, so the LRU may hold one more than its size while
  every other entry is in use.
- Slots: a step's adapters (at most --max-loras: the scheduler's cap) take slots before
  the step runs (`prepare`); an adapter keeps its slot until another one needs it, so a
  decode batch of the same adapters copies nothing. The step's requests are then ordered
  by slot, which makes each slot's rows one segment (punica.py).
"""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sluice.engine.lora.config import LoRAConfig
from sluice.engine.lora.layers import LoRAContext, LoRALinear
from sluice.engine.lora.peft_adapter import LoRAError, LoRAWeights, load_peft_adapter
from sluice.engine.lora.punica import LoRAMapping

log = logging.getLogger("sluice.engine.lora")


@dataclass(frozen=True)
class LoRARequest:
    """A registered adapter, as a request carries it."""

    name: str
    lora_id: int
    path: str

    @property
    def cache_key(self) -> str:
        """Its prefix-cache extra key: blocks computed with one adapter serve no other."""
        return f"lora:{self.lora_id}"


class LoRAManager:
    def __init__(self, config: LoRAConfig, model, dtype: torch.dtype):
        ctx: LoRAContext = model.lora
        assert ctx is not None, "the model was built without LoRA layers"
        self.config, self.ctx, self.model_config, self.dtype = config, ctx, model.config, dtype
        self.layers: dict[int, list[LoRALinear]] = {}  # layer index -> its LoRA linears
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                module.create_lora_weights(dtype)
                self.layers.setdefault(int(name.split(".")[2]), []).append(module)
        self.registered: dict[str, LoRARequest] = {}
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()  # lora_id -> weights, LRU
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> lora_id
        self._next_id = 1
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._loading: dict[int, Future] = {}  # lora_id -> its read, for a waiting request
        self._adding: list[tuple[object, str, str, Future]] = []  # (tag, name, path, read)
        self.failed: set[int] = set()  # ids whose re-read failed: the engine aborts their requests
        for module in config.modules:
            self.add(module.name, module.path)

    # -- registry -----------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoRARequest:
        """Load and register now (startup; tests); LoRAError if it cannot be served."""
        self._check_new(name)
        lora = self._register(name, path, self._read(path))
        self._evict(set())
        return lora

    def start_add(self, tag: object, name: str, path: str) -> None:
        """Load in the background; `finished_adds` reports (tag, error or None) later."""
        self._check_new(name)
        self._adding.append((tag, name, path, self._pool.submit(self._read, path)))

    def finished_adds(self, running: list) -> list[tuple[object, str | None]]:
        """Adds whose read ended since the last call, registered or refused; `running`:
        the running requests (their adapters stay loaded)."""
        if not self._adding:
            return []
        done, self._adding = ([a for a in self._adding if a[3].done()],
                              [a for a in self._adding if not a[3].done()])
        running_ids = {r.lora.lora_id for r in running if r.lora}
        results = []
        for tag, name, path, read in done:
            try:
                self._check_new(name)
                self._register(name, path, read.result())
            except LoRAError as exc:
                results.append((tag, str(exc)))
                continue
            self._evict(running_ids)
            results.append((tag, None))
        return results

    def remove(self, name: str) -> bool:
        """Unregister: new requests cannot name it; running ones finish with it."""
        lora = self.registered.pop(name, None)
        if lora is None:
            return False
        log.info("LoRA adapter %s unloaded", name)
        return True

    def pending(self) -> bool:
        return bool(self._adding or self._loading)

    def _check_new(self, name: str) -> None:
        if name in self.registered or any(a[1] == name for a in self._adding):
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")

    def _read(self, path: str) -> LoRAWeights:
        """The adapter's weights; whatever goes wrong reading a file a client named is a
        LoRAError (a 400), never an error of the engine."""
        try:
            return load_peft_adapter(path, self.model_config, self.config.max_lora_rank,
                                     self.dtype)
        except LoRAError:
            raise
        except Exception as exc:  # noqa: BLE001 -- e.g. a tensor torch cannot convert
            raise LoRAError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None
        finally:
            _release_freed_memory()

    def _register(self, name: str, path: str, weights: LoRAWeights) -> LoRARequest:
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self.registered[name] = lora
        self.loaded[lora.lora_id] = weights
        log.info("LoRA adapter %s loaded from %s: rank %d, %d modules, %.1f MiB", name, path,
                 weights.rank, len(weights.modules), weights.nbytes / 2**20)
        return lora

    # -- host memory --------------------------------------------------------------------
    def ready(self, lora: LoRARequest, running_ids: set[int]) -> bool:
        """Whether `lora` is in host memory; if not, read it in the background."""
        if lora.lora_id in self.loaded:
            self.loaded.move_to_end(lora.lora_id)
            return True
        read = self._loading.get(lora.lora_id)
        if read is None:
            self._loading[lora.lora_id] = self._pool.submit(self._read, lora.path)
            return False
        if not read.done():
            return False
        del self._loading[lora.lora_id]
        try:
            self.loaded[lora.lora_id] = read.result()
        except LoRAError as exc:  # its files changed or went since it was registered
            log.error("LoRA adapter %s no longer loads, unregistered: %s", lora.name, exc)
            if self.registered.get(lora.name) == lora:
                del self.registered[lora.name]
            self.failed.add(lora.lora_id)
            return False
        self._evict(running_ids | {lora.lora_id})
        return True

    def _evict(self, keep: set[int]) -> None:
        live = {lora.lora_id for lora in self.registered.values()}
        for lora_id in [i for i in self.loaded if i not in live and i not in keep]:
            del self.loaded[lora_id]  # unregistered and unused
        for lora_id in list(self.loaded):
            if len(self.loaded) <= self.config.cpu_capacity:
                break
            if lora_id not in keep:
                del self.loaded[lora_id]

    # -- slots ----------------------------------------------------------------------------
    def prepare(self, scheduled: list) -> LoRAMapping:
        """Give the step's adapters slots, order `scheduled` [(request, rows)] by slot in
        place, and return the step's mapping."""
        ids = {r.lora.lora_id for r, _ in scheduled if r.lora is not None}
        assert len(ids) <= len(self.slots), "the scheduler caps a step's adapters"
        for lora_id in ids - set(self.slots):
            slot = next(i for i, held in enumerate(self.slots) if held not in ids)
            deltas = self.loaded[lora_id].modules
            for layer, modules in self.layers.items():
                for module in modules:
                    module.set_lora(slot, {n: deltas[(layer, n)] for n in module.part_names
                                           if (layer, n) in deltas})
            self.slots[slot] = lora_id
        slot_of = {lora_id: i for i, lora_id in enumerate(self.slots) if lora_id is not None}

        def slot(req) -> int:
            return -1 if req.lora is None else slot_of[req.lora.lora_id]
        scheduled.sort(key=lambda pair: slot(pair[0]))
        return LoRAMapping.from_requests([(slot(r), n) for r, n in scheduled], self.ctx.device)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _release_freed_memory() -> None:
    """glibc keeps what a read freed (the file's bytes, the scaling's temporaries) in the
    reading thread's arena: a rank-16 adapter of the default model held 20.5 MiB resident
    for 9.3 MiB of weights, 8.0 MiB once trimmed. Hand it back (glibc only; else no-op)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

