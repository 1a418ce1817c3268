"""Reading a safetensors checkpoint directory: validated up front, tensors memory-mapped on demand.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (name -> dtype, shape,
data_offsets relative to the end of the header, plus an optional "__metadata__"), then the data. We
parse headers ourselves so that opening a directory checks every shard (presence, truncation, index
consistency) without reading a single tensor byte (docs/CHECKPOINT.md §7).

Tensors come from one read-only shared mapping per file (mmap PROT_READ, MAP_SHARED). Private
copy-on-write maps, which `safetensors.safe_open` uses, are refused for files larger than RAM + swap, and
the two Engram shards are ~94.6 GiB each (docs/CHECKPOINT.md §7). `torch.UntypedStorage.from_file(shared=True)`
is not used either: it opens the file read-write, so it fails on read-only files and would let a stray
in-place op modify the checkpoint. Consequence: tensors returned as views are read-only; clone before
writing into them.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from .spec import DTYPES, TensorSpec, itemsize, torch_dtype

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library refuses larger headers too
SHOW_FIRST = 5  # how many names an error message lists per category




def _first_few(items: list[str], n: int = SHOW_FIRST) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", … ({len(items) - n} more)" if len(items) > n else "")


# ---------------------------------------------------------------------------------------- headers
@dataclass(frozen=True)
class StoredTensor:
    spec: TensorSpec
    file: Path
    begin: int
    """Absolute byte offsets of the data in `file`."""
    end: int


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    file_size: int


def _parse_entry(path: Path, name: str, raw: object, data_start: int) -> StoredTensor:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path.name}: header entry for tensor {name} {why}")

    if not isinstance(raw, dict):
        raise bad("is not an object")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype not in DTYPES:
        raise bad(f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has invalid data_offsets {offsets!r}")
    spec = TensorSpec(name, dtype, tuple(shape))
    if offsets[1] - offsets[0] != spec.nbytes:
        raise bad(f"covers {offsets[1] - offsets[0]} bytes but {spec.describe()} needs {spec.nbytes}")
    return StoredTensor(spec, path, data_start + offsets[0], data_start + offsets[1])


def _read_header_json(path: Path) -> tuple[dict, int, int]:
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < HEADER_LENGTH_BYTES:
                raise CheckpointError(f"{path.name} is truncated: {file_size} bytes, shorter than the "
                                      f"header length field")
            (n,) = struct.unpack("<Q", f.read(HEADER_LENGTH_BYTES))
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path.name}: header length {n} is implausible (not a safetensors file?)")
            if HEADER_LENGTH_BYTES + n > file_size:
                raise CheckpointError(f"{path.name} is truncated: its header needs {HEADER_LENGTH_BYTES + n} bytes "
                                      f"but the file has {file_size}")
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path.name}: cannot read ({e})") from None
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not a JSON object")
    return header, HEADER_LENGTH_BYTES + n, file_size


def read_header(path: str | Path) -> ShardHeader:
    """Parse and check one safetensors file's header; reads no tensor data."""
    path = Path(path)
    header, data_start, file_size = _read_header_json(path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path.name}: __metadata__ is not an object")
    tensors = {name: _parse_entry(path, name, raw, data_start) for name, raw in header.items()}
    data_end = max((t.end for t in tensors.values()), default=data_start)
    if data_end > file_size:
        raise CheckpointError(f"{path.name} is truncated: its header says the data ends at byte {data_end} but the "
                              f"file has {file_size} bytes (incomplete download?)")
    _check_no_overlap(path, tensors)
    return ShardHeader(path, tensors, metadata, file_size)


def _check_no_overlap(path: Path, tensors: dict[str, StoredTensor]) -> None:
    ordered = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    for a, b in zip(ordered, ordered[1:]):
        if b.begin < a.end:
            raise CheckpointError(f"{path.name}: tensors {a.spec.name} and {b.spec.name} overlap")


# ---------------------------------------------------------------------------------------- the index
def _read_index(path: Path) -> tuple[dict, dict[str, str]]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path.name}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name}: cannot read ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
        raise CheckpointError(f"{path.name}: expected a JSON object with a \"weight_map\" object")
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path.name}: \"metadata\" is not an object")
    weight_map = raw["weight_map"]
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(f"{path.name}: weight_map entry for {name} is not a file in the directory: {file!r}")
    return metadata, weight_map


def _missing_shards(directory: Path, weight_map: dict[str, str]) -> str | None:
    users: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        users.setdefault(file, []).append(name)
    missing = sorted(f for f in users if not (directory / f).is_file())
    if not missing:
        return None
    detail = "; ".join(f"{f} (holds {len(users[f])} tensors, e.g. {users[f][0]})" for f in missing[:SHOW_FIRST])
    more = f"; … ({len(missing) - SHOW_FIRST} more)" if len(missing) > SHOW_FIRST else ""
    return (f"{INDEX_NAME} names {len(missing)} shard file(s) missing from {directory} "
            f"(partial download?): {detail}{more}")


# ---------------------------------------------------------------------------------------- the directory
class CheckpointDir:
    """A checkpoint directory (index + shards, or one model.safetensors), validated when opened."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path} does not exist")
        self.directory = path if path.is_dir() else path.parent
        self.index_metadata: dict = {}
        if path.is_file() and path.name != INDEX_NAME:
            weight_map = self._single_file(path)
        elif (self.directory / INDEX_NAME).is_file():
            self.index_metadata, weight_map = _read_index(self.directory / INDEX_NAME)
        elif (self.directory / SINGLE_NAME).is_file():
            weight_map = self._single_file(self.directory / SINGLE_NAME)
        else:
            raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        problem = _missing_shards(self.directory, weight_map)
        if problem:
            raise CheckpointError(problem)
        headers = {f: read_header(self.directory / f) for f in sorted(set(weight_map.values()))}
        self._tensors = self._resolve(weight_map, headers)
        self.shard_metadata = {f: h.metadata for f, h in headers.items()}
        self._maps: dict[Path, torch.Tensor] = {}
        self._mmaps: dict[Path, mmap.mmap] = {}

    def _single_file(self, path: Path) -> dict[str, str]:
        return {name: path.name for name in read_header(path).tensors}

    @staticmethod
    def _resolve(weight_map: dict[str, str], headers: dict[str, ShardHeader]) -> dict[str, StoredTensor]:
        lacking = [f"{name} (index says {file})" for name, file in weight_map.items()
                   if name not in headers[file].tensors]
        if lacking:
            raise CheckpointError(f"{INDEX_NAME} points {len(lacking)} tensor(s) at files whose header lacks them: "
                                  f"{_first_few(lacking)}")
        return {name: headers[file].tensors[name] for name, file in weight_map.items()}

    # ------------------------------------------------------------------ lookup
    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def _stored(self, name: str) -> StoredTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{name} is not in the checkpoint at {self.directory}") from None

    def spec(self, name: str) -> TensorSpec:
        return self._stored(name).spec

    def file_of(self, name: str) -> Path:
        return self._stored(name).file

    @property
    def total_bytes(self) -> int:
        return sum(t.spec.nbytes for t in self._tensors.values())

    # ------------------------------------------------------------------ data
    def _file_bytes(self, file: Path) -> torch.Tensor:
        """The whole file as a uint8 tensor over a read-only shared mapping (made once per file)."""
        if file not in self._maps:
            with open(file, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": intended
                self._maps[file] = torch.frombuffer(mapping, dtype=torch.uint8)
            self._mmaps[file] = mapping
        return self._maps[file]

    def _advise_random(self, stored: StoredTensor) -> None:
        """No read-ahead around touched pages: sparse row lookups read only the rows they touch."""
        mapping = self._mmaps[stored.file]
        if hasattr(mapping, "madvise") and stored.end > stored.begin:
            start = stored.begin - stored.begin % mmap.PAGESIZE
            mapping.madvise(mmap.MADV_RANDOM, start, stored.end - start)

    def _full(self, stored: StoredTensor) -> torch.Tensor:
        spec = stored.spec
        raw = self._file_bytes(stored.file)[stored.begin:stored.end]
        if stored.begin % itemsize(spec.dtype):
            raw = raw.clone()  # misaligned for the element type (never in files our writer makes)
        return raw.view(torch_dtype(spec.dtype)).view(spec.shape)

    def tensor(self, name: str, *, slice_dim: int | None = None, start: int | None = None,
               stop: int | None = None, random_access: bool = False) -> torch.Tensor:
        """The tensor, or rows/columns [start, stop) of `slice_dim`.

        Whole tensors and dim-0 slices are views of the mapping (no bytes read until used; read-only:
        writing into one faults); slices of any other dim are copied, and only the slice is copied.
        `random_access` turns off the kernel's read-ahead for the tensor (sparse lookups).
        """
        stored = self._stored(name)
        full = self._full(stored)
        if random_access:
            self._advise_random(stored)
        if slice_dim is None:
            if start is not None or stop is not None:
                raise ValueError(f"{name}: start/stop given without slice_dim")
            return full
        size = full.shape[slice_dim]
        start = 0 if start is None else start
        stop = size if stop is None else stop
        if not 0 <= start <= stop <= size:
            raise ValueError(f"{name}: slice [{start}, {stop}) of dim {slice_dim} is outside its size {size}")
        part = full.narrow(slice_dim, start, stop - start)
        if slice_dim % full.dim() == 0:
            return part
        return torch.empty(part.shape, dtype=part.dtype).copy_(part)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor read from its file into owned memory (`out`, if given, must match it).

        Unlike `tensor`, this never maps the file, so loading does not hold file pages on top of the
        tensors it builds: peak resident memory stays near the size of what is loaded.
        """
        stored = self._stored(name)
        spec = stored.spec
        dtype = torch_dtype(spec.dtype)
        if out is None:
            out = torch.empty(spec.shape, dtype=dtype)
        elif tuple(out.shape) != tuple(spec.shape) or out.dtype != dtype or not out.is_contiguous() \
                or out.device.type != "cpu":
            raise ValueError(f"{name}: cannot read {spec.dtype} {spec.shape} into {out.dtype} {tuple(out.shape)}")
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if out.numel() else memoryview(b"")
        with open(stored.file, "rb") as f:
            f.seek(stored.begin)
            got = f.readinto(view)
        if got != stored.end - stored.begin:
            raise CheckpointError(f"{stored.file.name}: short read of {name} ({got} of {stored.end - stored.begin} bytes)")
        return out

    # ------------------------------------------------------------------ layout check
    def validate_against(self, inventory: Mapping[str, TensorSpec]) -> None:
        """Raise one CheckpointError listing missing, unexpected, mis-shaped and mis-typed tensors."""
        missing = [n for n in inventory if n not in self._tensors]
        unexpected = [n for n in self._tensors if n not in inventory]
        both = [n for n in inventory if n in self._tensors]
        misshaped = [f"{n} is {self.spec(n).shape}, expected {inventory[n].shape}"
                     for n in both if self.spec(n).shape != tuple(inventory[n].shape)]
        mistyped = [f"{n} is {self.spec(n).dtype}, expected {inventory[n].dtype}"
                    for n in both if self.spec(n).dtype != inventory[n].dtype]
        if not (missing or unexpected or misshaped or mistyped):
            return
        groups = [("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped),
                  ("mis-typed", mistyped)]
        lines = [f"checkpoint at {self.directory} does not match the expected layout: "
                 + ", ".join(f"{len(items)} {label}" for label, items in groups)]
        lines += [f"  {label} ({len(items)}): {_first_few(items)}" for label, items in groups if items]
        error = CheckpointError("\n".join(lines))
        error.missing, error.unexpected, error.misshaped, error.mistyped = missing, unexpected, misshaped, mistyped
        raise error
