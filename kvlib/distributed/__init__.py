"""Beyond one machine: the cache across processes, as engines spread it across GPUs.

* `kvlib.distributed.launch`: `launch` (worker processes joined by gloo, stopped by their ids)
  and `alive`.
* `kvlib.distributed.tp`: tensor-parallel decode (Megatron's split), each rank caching its KV heads.
* `kvlib.distributed.disagg`: disaggregated prefill and decode, the cache sent layer by layer.
* `kvlib.distributed.disk`: a disk tier for prefixes (LMCache's shape), its files written by
  `kvlib.distributed.chunkfile`; `kvlib.distributed.tiered` runs a prompt through it.
* `kvlib.distributed.cluster`: the arithmetic of moving caches at cluster scale.
"""
