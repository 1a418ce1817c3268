"""Writing a checkpoint in the released layout: size-limited shards plus model.safetensors.index.json.

Shard files are named like the release (`model-00001-of-00048.safetensors`, docs/CHECKPOINT.md §1). The
safetensors format is written here directly (8-byte length, JSON header padded to 8 bytes, data), so
every dtype the release uses round-trips bit for bit, F8_E8M0 included, whatever the installed
safetensors library supports, and tensors are streamed to disk one at a time.

Crash safety: shards are written under temporary names and renamed only when all are complete; an
index left by an earlier save is removed before the renames and the new index is written last (also
via a temporary name), so no index ever points at missing or half-written data.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .progress import byte_progress
from .safetensors_io import INDEX_NAME
from .spec import dtype_name, itemsize
from ..errors import InputError

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the Hugging Face default shard size ("5GB")
HEADER_ALIGN = 8  # header padded with spaces so tensor data starts 8-byte aligned (safetensors convention)


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _as_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _header(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    return len(text).to_bytes(8, "little") + text


def _write_shard(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str], bar) -> None:
    # Widest elements first: with an 8-aligned header every tensor then starts aligned to its element
    # size, so readers can map it without copying.
    tensors = sorted(tensors, key=lambda item: -itemsize(dtype_name(item[1].dtype)))
    with open(path, "wb") as f:
        f.write(_header(tensors, metadata))
        for _, t in tensors:
            f.write(_as_bytes(t))
            bar.update(t.numel() * t.element_size())
        f.flush()
        os.fsync(f.fileno())


def _items(tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]):
    seen: set[str] = set()
    for name, t in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        if not isinstance(name, str) or name == "__metadata__":
            raise InputError(f"invalid tensor name {name!r}")
        if name in seen:
            raise InputError(f"tensor {name} given twice")
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} is a {type(t).__name__}, not a tensor")
        dtype_name(t.dtype)  # unsupported dtypes fail before anything is written
        seen.add(name)
        yield name, t


def _shards(items, max_shard_bytes: int):
    """Group tensors into shards in the order given; a tensor larger than the limit gets its own shard."""
    shard, size = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = [], 0
        shard.append((name, t))
        size += nbytes
    if shard:
        yield shard


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    metadata = dict(metadata or {})
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InputError(f"safetensors metadata must map str to str, got {k!r}: {v!r}")
    return metadata


def _fsync_directory(directory: Path) -> None:
    if sys.platform.startswith("linux"):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _old_shards(directory: Path) -> set[str]:
    try:
        return set(json.loads((directory / INDEX_NAME).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def _publish(directory: Path, temps: list[tuple[Path, list[str]]], index_metadata: dict) -> Path:
    old = _old_shards(directory)
    (directory / INDEX_NAME).unlink(missing_ok=True)  # from here until the new index, no index at all
    weight_map = {}
    for i, (temp, names) in enumerate(temps, start=1):
        final = shard_file_name(i, len(temps))
        os.replace(temp, directory / final)
        weight_map.update({name: final for name in names})
    index_temp = directory / f".{INDEX_NAME}.{uuid.uuid4().hex}.tmp"
    index_temp.write_text(json.dumps({"metadata": index_metadata, "weight_map": weight_map}, indent=2) + "\n")
    os.replace(index_temp, directory / INDEX_NAME)
    _fsync_directory(directory)
    for stale in old - set(weight_map.values()):  # shards of the earlier save that nothing names now
        (directory / stale).unlink(missing_ok=True)
    return directory / INDEX_NAME


def save_checkpoint(directory: str | Path,
                    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    metadata: Mapping[str, str] | None = None) -> Path:
    """Write `tensors` as shards of at most `max_shard_bytes` plus the index; returns the index path.

    `metadata` (str -> str) goes into every shard header and next to `total_size` in the index.
    """
    if max_shard_bytes <= 0:
        raise InputError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metadata = _check_metadata(metadata)
    known_total = (sum(t.numel() * t.element_size() for t in tensors.values())
                   if isinstance(tensors, Mapping) else None)
    token = uuid.uuid4().hex[:12]
    temps: list[tuple[Path, list[str]]] = []
    total = 0
    try:
        with byte_progress(known_total, f"writing {directory.name}") as bar:
            for i, shard in enumerate(_shards(_items(tensors), max_shard_bytes), start=1):
                temp = directory / f".model-{i:05d}.{token}.safetensors.tmp"
                temps.append((temp, [name for name, _ in shard]))
                _write_shard(temp, shard, metadata, bar)
                total += sum(t.numel() * t.element_size() for _, t in shard)
        return _publish(directory, temps, {**metadata, "total_size": total})
    finally:
        for temp, _ in temps:
            temp.unlink(missing_ok=True)
