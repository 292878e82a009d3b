"""AMPD's KV linker for SGLang: pages of SGLang's KV pool move between the workers' instances over
NIXL (ampd.kv.transport), so a remote prefill runs on top of the history the decode worker's
instance computed, and the decode instance then continues without recomputing the round.

SGLang's unified cache external linker (`UnifiedCacheLinker`, SGLang 0.5.23) is the hook: its radix
cache offers each page it completes to the linker (`offload`), and on a prefix miss it asks the
linker which of the next pages it can restore (`lookup`) and has it fill fresh KV slots with them
(`load`, then `start_layer_wise_loading`). Pages are keyed by SGLang's chained hash of the token
ids. This linker lives in SGLang's scheduler process:

- `offload` copies each page's K and V rows out of SGLang's pool into a page store of its own (an
  AMPD KVPool of one block per page, in the torch engine's row layout `[layers][k, v][kv_heads]
  [head_dim]`, registered with NIXL), and records in Redis under the page's key: the agent that
  holds it, the block and a CRC32 of its bytes.
- `lookup` counts the leading pages Redis knows; `load` reads each page from its holder's store
  over NIXL (its own store: a local copy), checks the CRC32 of every page's bytes, and writes the
  rows into the slots SGLang gave.
- Keys are namespaced per deployment namespace, model and KV layout (SGLang's page hashes name
  neither the model nor the layout).

On the CPU the copies are synchronous: SGLang's pool is plain tensors, and a load completes every
layer before `start_layer_wise_loading` returns. On a GPU the same interface must copy
asynchronously: an offload waits on `record_offload_ready()`'s events (the forward stream's writes)
and copies device->store on a side thread; a load issues each layer's copy store->device on a copy
stream and completes that layer in `layer_done_counter` when the copy's event fires, so the
forward overlaps the load layer by layer. That path is written down here, not run: this project's
machines have no GPU (docs/engines.md).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import zlib
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from ampd.kv import KVPool, Segment
from ampd.kv.layout import KVShape, pool_rows

__all__ = ["linker_config"]  # and AMPDKVLinker, built on first access (module __getattr__)

logger = logging.getLogger(__name__)

DEFAULT_STORE_PAGES = 1024  # pages each instance keeps for its peers (SmolLM2, 16-token pages: 0.75 GB)


def linker_config(kv_store: dict | None = None) -> str:
    """The `unified_cache_external_linker_config` of a worker's SGLang instance (JSON); empty
    without a store (no Redis to publish pages in): each instance then computes what it lacks."""
    if not kv_store or not kv_store.get("redis_url"):
        return ""
    return json.dumps({"linker": "AMPDKVLinker", "linker_module_path": __name__,
                       "linker_extra_config": {"store_pages": DEFAULT_STORE_PAGES, **kv_store}})


def _linker_base() -> type:
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

    return UnifiedCacheLinker


def __getattr__(name: str) -> Any:
    # SGLang's loader imports this module and takes the class: it is built on first access, so the
    # module imports (and linker_config runs) where SGLang is not installed.
    if name == "AMPDKVLinker":
        cls = _build_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _build_class() -> type:
    """AMPDKVLinker: the linker's methods (_Linker) on SGLang's UnifiedCacheLinker."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter

    class AMPDKVLinker(_Linker, _linker_base()):
        ampd_kv_pool = PoolName.KV
        ampd_load_counter = LayerWiseLoadCounter

    return AMPDKVLinker


class _Linker:
    """The linker's methods (module doc); ``_build_class`` puts them on SGLang's base class, with
    SGLang's name of its KV pool (``ampd_kv_pool``) and its layer-wise load counter (``ampd_load_counter``)."""

    ampd_kv_pool: Any
    ampd_load_counter: Any

    def __init__(self, server_args: Any, params: Any, *, components: Any = None, extra_config: dict | None = None,
                 forward_stream: Any = None) -> None:
        from ampd.state.url import sync_client

        del components
        cfg = dict(extra_config or {})
        self.forward_stream = forward_stream
        self.page = int(params.page_size)
        kv = params.token_to_kv_pool_allocator.get_kvcache()
        self.kv = kv
        self.pools = {self.ampd_kv_pool: kv}
        k0 = kv.k_buffer[0]
        self.layers = len(kv.k_buffer)
        self.shape = KVShape(self.layers, int(k0.shape[1]), int(k0.shape[2]), str(k0.dtype).removeprefix("torch."))
        self.layer_done_counter = self.ampd_load_counter(self.layers)
        layout = f"{os.path.basename(str(server_args.model_path).rstrip('/'))}|{self.shape}|page{self.page}"
        tag = hashlib.sha256(layout.encode()).hexdigest()[:16]
        self.prefix = f"{cfg.get('namespace', 'ampd')}:sglang-kv:{tag}"
        self.name = f"{cfg.get('worker', 'sglang')}-kv-{os.getpid()}"
        self.redis = sync_client(cfg["redis_url"])  # one Redis or its Sentinels (ampd.state.url)
        self.store = KVPool(int(cfg.get("store_pages", DEFAULT_STORE_PAGES)), self.page, self.shape.bytes_per_token)
        self.rows = pool_rows(self.store, self.shape)  # [store rows, layers, 2, kv_heads, head_dim]
        self.held: OrderedDict[str, int] = OrderedDict()  # page key -> block, oldest first
        self.pending: dict[str, Any] = {}  # rid -> its queued load transfer
        self.done: deque[bool] = deque()  # completed offloads not yet popped
        self.stats = {"pages_offloaded": 0, "pages_loaded_local": 0, "pages_loaded_remote": 0,
                      "bytes_read": 0, "bytes_mismatched": 0}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="ampd-kv-linker").start()
        self.transport = self._run(self._open())
        self.redis.hset(f"{self.prefix}:agents", self.name,
                        json.dumps({"layout": self.store.layout.to_dict(),
                                    "metadata": self.transport.metadata().hex()}))
        logger.info("AMPD KV linker %s: %d pages of %d tokens (%s)", self.name, self.store.num_blocks,
                    self.page, self.prefix)

    # --- plumbing ----------------------------------------------------------------------------
    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _open(self) -> Any:
        from ampd.kv.transport import NixlTransport

        return NixlTransport(self.name, self.store)

    async def _connect(self, peer: str) -> None:
        raw = self.redis.hget(f"{self.prefix}:agents", peer)
        if raw is None:
            raise RuntimeError(f"KV linker peer {peer!r} is not registered")
        info = json.loads(raw)
        self.transport.add_peer(peer, bytes.fromhex(info["metadata"]), info["layout"], warm_s=0)

    def _slots(self, transfer: Any) -> Any:
        import torch

        return transfer.device_indices.to(torch.int64).cpu()

    def _kv_transfer(self, transfers: list) -> Any:
        return next((t for t in transfers if t.name == self.ampd_kv_pool), None)

    # --- UnifiedCacheLinker --------------------------------------------------------------------
    def lookup(self, rid: str, transfers: list) -> list[int]:
        t = self._kv_transfer(transfers)
        if t is None or not t.keys:
            return []
        found = self.redis.hmget(f"{self.prefix}:pages", list(t.keys))
        n = next((i for i, v in enumerate(found) if v is None), len(found))
        return list(range(1, n + 1))

    def load(self, rid: str, transfers: list) -> bool:
        t = self._kv_transfer(transfers)
        if t is None or not t.keys:
            return False
        self.pending[rid] = t
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending:
            return -1
        pending, self.pending = list(self.pending.values()), {}
        index = self.layer_done_counter.update_producer()
        try:
            for t in pending:
                self._load(list(t.keys), self._slots(t))
        except BaseException as exc:
            logger.exception("AMPD KV linker: load failed")
            self.layer_done_counter.fail(index, exc)
            return index
        for layer in range(self.layers):
            self.layer_done_counter.complete(index, layer)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def _load(self, keys: list[str], slots: Any) -> None:
        import torch

        entries = self.redis.hmget(f"{self.prefix}:pages", keys)
        staging = self.store.alloc(len(keys))
        try:
            by_peer: dict[str, list[tuple[int, int]]] = {}
            crcs = []
            for i, (key, raw) in enumerate(zip(keys, entries)):
                if raw is None:
                    raise RuntimeError(f"page {key} left the store between lookup and load")
                agent, block, crc = json.loads(raw)
                crcs.append(crc)
                if agent == self.name and self.held.get(key) == block:
                    self.store.buffer[self._span(staging[i])] = self.store.buffer[self._span(block)]
                    self.stats["pages_loaded_local"] += 1
                else:
                    by_peer.setdefault(agent, []).append((block, staging[i]))
            for agent, pairs in by_peer.items():
                self._run(self._read(agent, pairs))
                self.stats["pages_loaded_remote"] += len(pairs)
            for i, block in enumerate(staging):
                data = self.store.buffer[self._span(block)]
                self.stats["bytes_read"] += data.nbytes
                if zlib.crc32(data) != crcs[i]:
                    self.stats["bytes_mismatched"] += data.nbytes
                    raise RuntimeError(f"page {keys[i]}: its bytes do not match the CRC32 its holder recorded")
            rows = torch.from_numpy(self.rows[np.concatenate([np.arange(b * self.page, (b + 1) * self.page)
                                                              for b in staging])])
            for layer in range(self.layers):
                self.kv.k_buffer[layer][slots] = rows[:, layer, 0].to(self.kv.k_buffer[layer].device)
                self.kv.v_buffer[layer][slots] = rows[:, layer, 1].to(self.kv.v_buffer[layer].device)
        finally:
            self.store.free(staging)

    async def _read(self, agent: str, pairs: list[tuple[int, int]]) -> None:
        if not self.transport.has_peer(agent):
            await self._connect(agent)
        await self.transport.read(agent, [Segment(b, 0, self.page) for b, _ in pairs],
                                  [Segment(s, 0, self.page) for _, s in pairs])

    def _span(self, block: int) -> slice:
        n = self.store.block_bytes
        return slice(block * n, (block + 1) * n)

    def offload(self, transfers: list, session_id: str | None = None) -> bool:
        t = self._kv_transfer(transfers)
        if t is None or not t.keys:
            return False
        slots = self._slots(t)
        entries = {}
        for i, key in enumerate(t.keys):
            if key in self.held:
                self.held.move_to_end(key)
                continue
            block = self._free_block()
            rows = slice(block * self.page, (block + 1) * self.page)
            page_slots = slots[i * self.page:(i + 1) * self.page]
            for layer in range(self.layers):
                self.rows[rows, layer, 0] = self.kv.k_buffer[layer][page_slots].cpu().numpy()
                self.rows[rows, layer, 1] = self.kv.v_buffer[layer][page_slots].cpu().numpy()
            self.held[key] = block
            entries[key] = json.dumps([self.name, block, zlib.crc32(self.store.buffer[self._span(block)])])
        if entries:
            self.redis.hset(f"{self.prefix}:pages", mapping=entries)
            self.stats["pages_offloaded"] += len(entries)
        self.done.append(True)
        return True

    def _free_block(self) -> int:
        """A store block for a new page; the oldest page goes when the store is full (its
        Redis entry too, where it still names this store)."""
        if self.store.free_blocks == 0:
            key, block = self.held.popitem(last=False)
            raw = self.redis.hget(f"{self.prefix}:pages", key)
            if raw is not None and json.loads(raw)[:2] == [self.name, block]:
                self.redis.hdel(f"{self.prefix}:pages", key)
            self.store.free([block])
        return self.store.alloc(1)[0]

    def num_completed_offloads(self) -> int:
        return len(self.done)

    def pop_completed_offload(self) -> bool:
        return self.done.popleft()

    def reset(self) -> None:
        self.pending.clear()
        self.done.clear()

    def close(self) -> None:
        self.reset()
        try:
            self.redis.hdel(f"{self.prefix}:agents", self.name)
            mine = [k for k in self.held]
            if mine:
                self.redis.hdel(f"{self.prefix}:pages", *mine)
        except Exception:  # Redis gone with the deployment
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
