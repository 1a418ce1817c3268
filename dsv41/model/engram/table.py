"""Engram embedding table: fp8 rows with 1x32 ue8m0 scales, read sparsely, possibly from a mapped file.

Shapes: R table rows, De row width (engram_head_dim), N hash columns, `...` any leading shape.

A released table is ~94.6 GiB (docs/CHECKPOINT.md §7), more than most hosts' RAM. It is mapped read-only
and SHARED (a private copy-on-write mapping of a file larger than RAM is refused by Linux) and only
the rows a lookup touches are ever read from disk. The table may live on another device than the
model (host memory, a mapped file); `lookup` gathers where the table is and ships the still-fp8 rows
(264 B per row instead of 512 B as bf16) to the requested device before dequantising.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ...errors import CheckpointError
from .. import formats

SCALE_BLOCK = formats.ENGRAM_BLOCK  # one ue8m0 scale per 32 values of a row (docs/ARCHITECTURE.md §6.2)


def map_safetensors_tensor(path: str | os.PathLike, name: str, *, random_access: bool = False) -> torch.Tensor:
    """One tensor of a safetensors file as a read-only, shared memory map (no byte read until used).

    Writing to the result faults: it is mapped PROT_READ. `random_access` tells the kernel not to
    read ahead around each touched page (sparse row lookups)."""
    from ...checkpoint.safetensors_io import CheckpointDir

    return CheckpointDir(path).tensor(name, random_access=random_access)


# ---------------------------------------------------------------- the table ---------------------


class EngramTable(nn.Module):
    """`weight` e4m3 [R, De] and `scale` ue8m0 [R, De/32]: value(r, i) = weight[r, i] · scale[r, i // 32]
    (docs/CHECKPOINT.md §2). Registered as `embed`, the names are the checkpoint's
    `layers.L.engram.embed.weight` / `.scale`.

    `movable=False` pins the table where it is: `model.to(...)` then leaves it alone, so a mapped
    or host-resident table is not copied onto the accelerator with the rest of the model.

    Under tensor parallelism the table holds rows [first, first + rows) of the full table; a lookup
    of any other row gives zeros, and the caller sums the ranks' lookups (ARCHITECTURE.md §9).
    """

    def __init__(self, rows: int, head_dim: int, *, device=None, movable: bool = True,
                 part: tuple[int, int] | None = None):
        super().__init__()
        if head_dim % SCALE_BLOCK:
            raise ValueError(f"Engram head_dim {head_dim} must be a multiple of {SCALE_BLOCK}")
        self.full_rows = rows
        self.first, stop = part or (0, rows)
        self.rows, self.head_dim, self.movable, self.read_only = stop - self.first, head_dim, movable, False
        self.weight = nn.Parameter(torch.empty(self.rows, head_dim, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.empty(self.rows, head_dim // SCALE_BLOCK, dtype=torch.float8_e8m0fnu,
                                              device=device), requires_grad=False)

    def attach(self, weight: torch.Tensor, scale: torch.Tensor, *, movable: bool = False,
               read_only: bool = False) -> None:
        """Use `weight`/`scale` (e.g. mapped from a file) as the table, without copying them."""
        want = {"weight": ((self.rows, self.head_dim), torch.float8_e4m3fn),
                "scale": ((self.rows, self.head_dim // SCALE_BLOCK), torch.float8_e8m0fnu)}
        for name, t in (("weight", weight), ("scale", scale)):
            shape, dtype = want[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise CheckpointError(f"Engram table {name}: expected {shape} {dtype}, got {tuple(t.shape)} {t.dtype}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.movable, self.read_only = movable, read_only

    @classmethod
    def from_safetensors(cls, path: str | os.PathLike, weight_name: str, scale_name: str) -> "EngramTable":
        weight = map_safetensors_tensor(path, weight_name, random_access=True)
        scale = map_safetensors_tensor(path, scale_name, random_access=True)
        if weight.ndim != 2:
            raise CheckpointError(f"{path}: {weight_name} must be 2-D, got shape {tuple(weight.shape)}")
        table = cls(weight.shape[0], weight.shape[1], device="meta")
        table.attach(weight, scale, movable=False, read_only=True)
        return table

    def _apply(self, fn, recurse=True):
        if not self.movable:
            return self
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Copying into a PROT_READ mapping would crash the process; fail with a message instead.
        assigning = local_metadata.get("assign_to_params_buffers", False)
        if self.read_only and not assigning and any(k.startswith(prefix) for k in state_dict):
            error_msgs.append(f"{prefix}weight/scale: the Engram table is a read-only file mapping; "
                              "use load_state_dict(..., assign=True) or EngramTable.attach")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def lookup(self, ids: torch.Tensor, device=None, numerics=None) -> torch.Tensor:
        """ids int64 [..., N] -> bf16 [..., N, De] on `device` (default: the ids' device).

        Only the requested rows are read; dequantisation is an fp32 multiply then one bf16 rounding
        (docs/ARCHITECTURE.md §9 step 1), done on the destination device. With a `numerics` policy, a
        host table looked up into host memory may take its one-pass kernel (the same values)."""
        out_device = torch.device(device) if device is not None else ids.device
        if numerics is not None and out_device.type == "cpu":
            rows = numerics.engram_rows(self.weight, self.scale, ids.to(self.weight.device), self.first)
            if rows is not None:
                return rows
        flat = ids.reshape(-1).to(self.weight.device) - self.first
        elsewhere = None
        if self.rows < self.full_rows:
            elsewhere = (flat < 0) | (flat >= self.rows)
            flat = flat.masked_fill(elsewhere, 0)
        # Gather as raw bytes: plain byte copies, on whatever device holds the table.
        w = self.weight.view(torch.uint8).index_select(0, flat)  # [M, De]
        s = self.scale.view(torch.uint8).index_select(0, flat)  # [M, De/32]
        # Asynchronous only towards an accelerator: a non-blocking copy into host memory may still be
        # in flight when the host reads it.
        async_copy = out_device.type != "cpu"
        w = w.to(out_device, non_blocking=async_copy).view(torch.float8_e4m3fn)
        s = s.to(out_device, non_blocking=async_copy).view(torch.float8_e8m0fnu)
        rows = formats.dequantize_fp8_rows(w, s).to(torch.bfloat16)
        if elsewhere is not None:
            rows = rows.masked_fill(elsewhere.to(out_device).unsqueeze(-1), 0)
        return rows.view(*ids.shape, self.head_dim)

    def extra_repr(self) -> str:
        part = "" if self.rows == self.full_rows else f" of {self.full_rows} from {self.first}"
        return f"rows={self.rows}{part}, head_dim={self.head_dim}, device={self.weight.device}, movable={self.movable}"
