"""vLLM's paged pool as a trace in kvlib's format (``kv-pool-trace/1``, `kvlib.paged.trace`). Runs in vLLM's environment.

`VllmPoolTrace` watches one ``vllm.LLM`` whose engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one ``LLMEngine.step()`` at a time. It reads two things:

* the **KV-cache manager's state** after each step (vllm/v1/core/kv_cache_manager.py and the
  single-type manager's ``req_to_blocks``: every request's block ids; the ``BlockPool``'s blocks,
  their reference counts and content hashes, its free count); and the blocks each request gives
  back, read in ``KVCacheManager.free`` just before vLLM frees them (a preemption, or a finished
  request);
* **vLLM's own KV-cache events**, enabled with ``KVEventsConfig(enable_kv_cache_events=True,
  publisher="null")``: the scheduler hands each step's batch (``BlockStored``: a full block's
  content hash became findable; ``BlockRemoved``: a hash was dropped, the block evicted for reuse;
  ``AllBlocksCleared``) to its ``kv_event_publisher``, which this recorder replaces to keep them.

The events name blocks by content hash only, so each hash is mapped to the block holding it (before
the step for a removal, after it for a store). Block ids are vLLM's less one: its block 0 is the
null block, never handed to a request, so the trace's pool is ids ``0 .. num_gpu_blocks - 2``, as
kvlib's pool of the same usable size. Everything else (admissions, hits, allocations,
preemptions, frees) is the difference between the manager's tables before and after the step; what
vLLM's events could not tell is listed in the trace's ``missing``.
"""

from __future__ import annotations

MISSING = [
    "vLLM's KV-cache events (BlockStored, BlockRemoved) name blocks by content hash, not by block id: "
    "the ids here are the KV-cache manager's, read from its block tables and pool after each step",
    "the events name no request: admissions, prefix hits and allocations are the difference between "
    "the manager's per-request block tables before and after a step, and preemptions and frees are "
    "read from KVCacheManager.free as vLLM calls it",
    "no event marks a block allocated before it is full, a prefix hit (unless kv_cache_report_mode "
    "is 'full'), a free or a preemption; only storing and dropping a full block's hash are events",
    "a partly filled block is never stored or hashed, so how full it is comes from the request's "
    "num_computed_tokens, not from an event",
    "the order of events within one step is rebuilt (preemptions, admissions and allocations, seals, "
    "frees), not observed: vLLM publishes a step's events as one batch",
    "no fork or copy-on-write: vLLM runs an n > 1 request as n requests sharing the prompt's full "
    "blocks through the prefix cache",
    "(not missing, renamed: block ids are vLLM's less one, since its block 0 is the null block)",
]


class VllmPoolTrace:
    """Records ``llm``'s pool step by step: call `before` and `after` around each ``LLMEngine.step()``."""

    def __init__(self, llm) -> None:
        import vllm
        from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

        core = llm.llm_engine.engine_core.engine_core  # the in-process EngineCore (InprocClient)
        self.scheduler = core.scheduler
        self.manager = self.scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        managers = self.manager.coordinator.single_type_managers
        if len(managers) != 1 or not self.scheduler.enable_kv_cache_events or self.pool.null_block.block_id != 0:
            raise ValueError(f"a pool trace needs one KV-cache group ({len(managers)} here), KV-cache events on "
                             "and the null block at id 0")
        self.tables_of = managers[0].req_to_blocks
        self._hash = lambda h: maybe_convert_block_hash(get_block_hash(h))
        self.batches: list = []
        self.scheduler.kv_event_publisher = self  # publish() below keeps each step's batch
        self.freed: list[tuple[str, bool, list[int]]] = []
        free = self.manager.free

        def watched_free(request):  # the blocks a request gives back, read just before vLLM frees them
            ids = [b.block_id - 1 for b in self.tables_of.get(request.request_id, ())]
            self.freed.append((request.request_id, request.is_finished(), ids))
            return free(request)

        self.manager.free = watched_free
        self.names: dict[str, str] = {}  # vLLM's request id (with its random suffix) -> the workload's
        self.trace = {"format": "kv-pool-trace/1", "engine": f"vllm {vllm.__version__}",
                      "num_blocks": self.pool.num_gpu_blocks - 1,  # less the null block, as kvlib's pool is
                      "block_size": self.manager.coordinator.single_type_managers[0].block_size,
                      "requests": {}, "steps": [], "missing": MISSING}

    # the publisher's interface (vllm.distributed.kv_events.EventPublisher)
    def publish(self, batch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass

    def add(self, vllm_id: str, name: str, prompt: int, max_tokens: int) -> None:
        """A request added before the next step: ``vllm_id`` is what ``add_request`` returned."""
        self.names[vllm_id] = name
        self.trace["requests"][name] = {"prompt": prompt, "max_new_tokens": max_tokens,
                                        "arrive": len(self.trace["steps"])}

    def _snapshot(self) -> dict:
        blocks = [b for b in self.pool.blocks if not b.is_null]
        return {"tables": {r: [b.block_id - 1 for b in bl] for r, bl in self.tables_of.items() if bl},
                "hashes": {b.block_id - 1: self._hash(b.block_hash) for b in blocks if b.block_hash is not None},
                "cached": sum(1 for b in blocks if b.ref_cnt == 0 and b.block_hash is not None),
                "free": self.pool.get_num_free_blocks()}

    def before(self) -> None:
        self._s0, self.freed, self.batches = self._snapshot(), [], []

    def after(self) -> None:
        """Turn the step's state change and vLLM's events into the trace's step."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        s0, s1, name = self._s0, self._snapshot(), self.names.get
        by_hash0 = {h: b for b, h in s0["hashes"].items()}
        by_hash1 = {h: b for b, h in s1["hashes"].items()}
        stored, removed = [], []
        for ev in (e for batch in self.batches for e in batch.events):
            if isinstance(ev, BlockStored):
                stored += [by_hash1[h] for h in ev.block_hashes if h in by_hash1]
            elif isinstance(ev, BlockRemoved):
                removed += [by_hash0[h] for h in ev.block_hashes if h in by_hash0]
            elif isinstance(ev, AllBlocksCleared):
                removed += list(s0["hashes"])
        events = []
        for rid, finished, table in self.freed:  # a preemption frees before any admission of the step
            if not finished:
                events.append({"kind": "preempt", "seq": name(rid, rid), "blocks": table[::-1]})
        finals = dict(s1["tables"])
        finals.update({rid: t for rid, finished, t in self.freed if finished})
        evicted = set(removed)
        preempted = {rid for rid, finished, _ in self.freed if not finished}
        for rid, final in finals.items():
            base = None if rid in preempted else s0["tables"].get(rid)  # None: admitted in this step
            key = name(rid, rid)
            if base is None:
                hits = []
                for b in final:  # a leading run of blocks that held a cached prefix before the step
                    if b not in s0["hashes"] or b in evicted:
                        break
                    hits.append(b)
                events.append({"kind": "admit", "seq": key, "cached_tokens": len(hits) * self.trace["block_size"]})
                if hits:
                    events.append({"kind": "hit", "seq": key, "blocks": hits})
                base = hits
            if final[: len(base)] != base:
                raise RuntimeError(f"request {key}: its table changed from {base} to {final} in one step")
            new = final[len(base):]
            if [b for b in new if b in evicted]:
                events.append({"kind": "evict", "blocks": [b for b in new if b in evicted]})
            if new:
                events.append({"kind": "allocate", "seq": key, "blocks": new})
        left = [b for b in evicted if b not in {x for t in finals.values() for x in t}]
        if left:
            events.append({"kind": "evict", "blocks": left})
        seals = [b for b in dict.fromkeys(stored) if b not in s0["hashes"] or b in evicted]
        changed = {b for b, h in s0["hashes"].items() if s1["hashes"].get(b) != h}
        if not changed <= evicted or set(seals) != {b for b, h in s1["hashes"].items() if s0["hashes"].get(b) != h}:
            raise RuntimeError(f"step {len(self.trace['steps'])}: vLLM's events (stored {stored}, removed "
                               f"{removed}) disagree with its pool's hashes before and after the step")
        if seals:
            events.append({"kind": "seal", "blocks": seals})
        for rid, finished, table in self.freed:
            if finished:
                events.append({"kind": "free", "seq": name(rid, rid), "blocks": table[::-1]})
        n = self.trace["num_blocks"]
        reqs = self.scheduler.requests
        self.trace["steps"].append({
            "step": len(self.trace["steps"]), "events": events,
            "tables": {name(r, r): t for r, t in s1["tables"].items()},
            "lengths": {name(r, r): int(reqs[r].num_computed_tokens) for r in s1["tables"]},
            "counts": {"used": n - s1["free"], "cached": s1["cached"], "free": s1["free"]}})
