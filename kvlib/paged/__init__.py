"""Paged KV memory (vLLM's PagedAttention), one idea per module:

* `kvlib.paged.blocks`: `BlockAllocator`, the block ids, free list, reference counts and
  prefix index (a hash chain over full blocks); `OutOfBlocks`; `check_block_tables`, whether a set of
  block tables and the reference counts agree (`BlockTableError` if not). No tensors.
* `kvlib.paged.cache`: `PagedCache`, the per-layer pools and each sequence's block table:
  ``add``, ``fork`` (copy-on-write), ``truncate``, ``free``, and ``step``.
* `kvlib.paged.batch`: `slot_mapping`, `gather`, and the `kvlib.Cache` one forward runs
  against: `PagedBatch` (a rectangle, ``T`` new tokens each) or `PackedPagedBatch` (one
  packed row of ragged steps); committing it is the only way a step reaches the pool. The
  step's life and checks live here; `StepPool` names what a step needs of its cache.
* `kvlib.paged.hybrid`: `HybridBlockPool`, one pool for a hybrid model's KV-cache groups
  (`kv_groups`), a block table per group, window layers giving back the blocks they have
  passed (`blocks_held`), prefix hits every group can serve. No tensors.
* `kvlib.paged.varlen`: `VarlenPlan` and `paged_varlen_attention`, a packed step's attention with
  each sequence over its own keys only (what `PackedPagedBatch` runs by default).
* `kvlib.paged.kernel`: `paged_attention_loop`, the paged kernel's block-by-block loop.
* `kvlib.paged.trace`: `PoolTrace`, every block event of an `kvlib.Engine` run and the pool after
  each step (format ``kv-pool-trace/1``, shared with vLLM's side of the cross-check).
* `kvlib.paged.replay`: `replay`, the pool rebuilt from a trace's events alone, step by step, and
  checked against the trace's own tables and counts, and `validate`.

Every name is importable from ``kvlib.paged`` itself, except the replay module's: ``kvlib.paged.replay``
is that module, so ``from kvlib.paged.replay import replay, validate``.
"""

from .batch import PackedPagedBatch, PagedBatch, StepPool, gather, slot_mapping
from .blocks import BlockAllocator, BlockTableError, OutOfBlocks, chain_hash, check_block_tables
from .cache import PagedCache
from .hybrid import HybridBlockPool, KVGroup, blocks_held, kv_groups
from .kernel import paged_attention_loop
from .trace import PoolTrace
from .varlen import VarlenPlan, paged_varlen_attention

__all__ = ["BlockAllocator", "BlockTableError", "HybridBlockPool", "KVGroup", "OutOfBlocks", "PackedPagedBatch",
           "PagedBatch", "PagedCache", "PoolTrace", "StepPool", "VarlenPlan", "chain_hash", "check_block_tables",
           "gather", "blocks_held", "kv_groups", "paged_attention_loop", "paged_varlen_attention", "slot_mapping"]
