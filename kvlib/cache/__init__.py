"""Where the keys and values live between decode steps.

* `kvlib.cache.protocol`: `Cache`, the protocol every kvlib cache follows (Hugging Face's
  ``update(key_states, value_states, layer_idx)``, ``get_seq_length``, ``crop``, ``reset``,
  plus the positions and mask of a step), with the bookkeeping they share (`CacheSpec`,
  ``nbytes``, ``bytes_written``, `own`); `nbytes_of`.
* `kvlib.cache.dynamic`: `DynamicCache`, which grows with ``torch.cat``: simple, but every
  step copies the whole cache into a fresh tensor.
* `kvlib.cache.static`: `StaticCache`, preallocated ``(batch, kv_heads, max_len, head_dim)``
  per layer and written in place; with ``grow=True`` it doubles when full.

Every name is importable from ``kvlib.cache`` itself.
"""

from .dynamic import DynamicCache
from .protocol import Cache, CacheSpec, Legacy, model_layout, nbytes_of
from .static import StaticCache

__all__ = ["Cache", "CacheSpec", "DynamicCache", "Legacy", "StaticCache", "model_layout", "nbytes_of"]
