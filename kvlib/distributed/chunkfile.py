"""One chunk of K/V as a file: a safetensors layout, a checksum, an atomic write, a verified read.

A safetensors file is 8 bytes (the header's length, little-endian), a JSON header (each
tensor's dtype, shape and byte range, plus a ``__metadata__`` dict of strings), then the raw
tensor bytes. A chunk file holds two tensors, ``keys`` and ``values``, each
``(n_layer, H_kv, chunk_tokens, D)``, and metadata saying what they are: the format, the
model fingerprint, the chunk's key, its parent's key, its token ids, and the sha256 of the
tensor bytes. `kvlib.distributed.disk` names and indexes these files.

Two ways a file can lie, and what stops each:

* **A partial file** (the writer died, the disk filled): `write_temp` writes under a temp
  name, flushes and fsyncs; only then does the store ``os.replace`` it onto the real name,
  which is atomic on POSIX and Windows, so a reader opens the old file, the whole new one,
  or none. A killed writer leaves only a temp file, which lookups never open.
* **A damaged file** (a flipped bit on the disk, a truncated copy): `decode` recomputes the
  checksum over the tensor bytes and rejects the file on any mismatch or parse error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "kvlib-disk-1"
SUFFIX = ".safetensors"  # a stored chunk: <key>.safetensors
TEMP_SUFFIX = ".tmp"  # a write in flight: .<key>.<pid>.<random>.tmp
_PIECE_BYTES = 1 << 20  # a chunk is written in pieces of this size


class StoreError(OSError):
    """A chunk could not be written (the disk is full, say). Nothing partial is left behind;
    ``report`` (a `kvlib.distributed.disk.PutReport`) says which chunks were stored before it."""

    report = None


def checksum(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' raw bytes, in order, as 64 hex digits (any dtype, bf16 too)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def encode(k: torch.Tensor, v: torch.Tensor, **meta: str) -> bytes:
    """The file's bytes: ``keys`` and ``values`` ``(L, H_kv, n, D)``, ``meta`` and their checksum."""
    return st_save({"keys": k, "values": v}, metadata={"format": FORMAT, **meta, "sha256": checksum(k, v)})


def decode(data: bytes) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """``(metadata, keys, values)`` of a whole chunk file; ``ValueError`` for anything else.

    Any damage (a bad length, broken JSON, a missing field, offsets past the end, a wrong
    checksum) raises ``ValueError``: the caller treats the file as absent.
    """
    try:
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n])["__metadata__"]
        tensors = st_load(data)
        k, v = tensors["keys"], tensors["values"]
        meta = {**meta, "tokens": json.loads(meta["tokens"])}
        fields_ok = meta["format"] == FORMAT and all(isinstance(meta[f], str) for f in ("key", "parent", "fingerprint"))
        sum_ok = meta["sha256"] == checksum(k, v)
    except Exception as e:  # noqa: BLE001 - whatever the damage, the file is not a chunk
        raise ValueError(f"not a chunk file: {type(e).__name__}: {e}") from None
    if not fields_ok or not sum_ok:
        raise ValueError("not a chunk file: " + ("the tensor bytes fail their checksum" if fields_ok else "bad metadata"))
    return meta, k, v


def _write_pieces(f, data: bytes) -> None:
    """Write ``data`` to the open file ``f`` piece by piece (a test slows this down to kill a writer)."""
    view = memoryview(data)
    for start in range(0, len(view), _PIECE_BYTES):
        f.write(view[start : start + _PIECE_BYTES])


def write_temp(root: Path, key: str, data: bytes) -> Path:
    """``data`` in a new temp file in ``root`` (where the final file will be: the same filesystem,
    so the rename is atomic), on disk (fsynced) before it returns. Raises `StoreError`, and
    removes the temp file, if any write fails."""
    tmp = root / f".{key}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    try:
        with open(tmp, "xb") as f:  # "x": never another writer's file
            _write_pieces(f, data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before a name points at them
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise StoreError(e.errno, f"could not write a {len(data)}-byte chunk to {root}: "
                                  f"{e.strerror or e}; no partial file is left") from e
    return tmp


def temp_writer(path: Path) -> int | None:
    """The pid in a temp file's name, or None if ``path`` is not a temp file."""
    parts = path.name.split(".")
    if not (path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX)) or len(parts) != 5:
        return None
    return int(parts[2]) if parts[2].isdigit() else None
