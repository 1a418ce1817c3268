"""One allocation for a model's CPU weights, backed by 2 MB pages where the kernel offers them
(docs/NUMERICS.md N32).

A decode step streams every weight it reads once, from memory. On 4 KB pages that stream takes a TLB
miss and a page walk every 4 KB and the hardware prefetchers stop at every page boundary; a tensor
torch allocates on its own gets 4 KB pages unless the process set `THP_MEM_ALLOC_ENABLE` before its
first allocation (a process-wide switch), and tensors under 2 MB never get more. Placing every weight in
one buffer that is advised as huge-page memory (`madvise(MADV_HUGEPAGE)`, Linux's transparent huge pages
in their default `madvise` mode) before any of it is touched gives the whole model 2 MB pages: the
routed experts of a dim-1024 decode step stream at 24 GB/s where they streamed at 17.

The buffer is reserved untouched (torch's allocator maps large blocks lazily), so pages become resident
as tensors are written into their slots: a loader that fills slot after slot never holds more than the
model plus the tensor in hand. Where madvise does not exist or is refused, the arena is still one
buffer; nothing else changes.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

HUGE_PAGE = 2 << 20
# Linux's <sys/mman.h> MADV_HUGEPAGE.
MADV_HUGEPAGE = 14
# Every slot starts on this boundary: a cache line for the kernels' vector loads, whole lines for their
# prefetches.
SLOT_ALIGN = 256


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask the kernel to back [address, address + length) (whole 2 MB pages, not yet touched) with huge
    pages. False where the platform or the kernel says no."""
    if not sys.platform.startswith("linux") or address % HUGE_PAGE or length % HUGE_PAGE or length <= 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)          # the process's own symbols: libc's madvise
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(address, length, MADV_HUGEPAGE) == 0


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """(uint8 [nbytes] CPU tensor, advised): a view starting on a 2 MB boundary of an untouched
    allocation that it keeps alive, its pages advised up to the next 2 MB boundary (so a small arena
    still gets one huge page)."""
    pages = max(1, -(-nbytes // HUGE_PAGE))
    raw = torch.empty((pages + 1) * HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes], advise_huge_pages(raw.data_ptr() + start, pages * HUGE_PAGE)


class WeightArena:
    """Slots for named tensors (shape, dtype) in one huge-page buffer; `place` moves a value into its
    slot. Names without a slot pass through unchanged."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.offsets: dict[str, int] = {}
        self.specs = dict(specs)
        size = 0
        for name, (shape, dtype) in self.specs.items():
            self.offsets[name] = size
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            size += -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
        self.buffer, self.advised = huge_page_buffer(size)

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> "WeightArena":
        """Slots with the shapes and dtypes of `tensors` (meta tensors will do)."""
        return cls({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})

    def slot(self, name: str) -> torch.Tensor | None:
        if name not in self.specs:
            return None
        shape, dtype = self.specs[name]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        at = self.offsets[name]
        return self.buffer[at:at + nbytes].view(dtype).view(shape)

    def place(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value` in its slot (copied unless it already is the slot), or `value` itself where the name
        has no slot or the slot's shape and dtype are not the value's."""
        slot = self.slot(name)
        if slot is None or value.device.type != "cpu" or slot.shape != value.shape or slot.dtype != value.dtype:
            return value
        if value.data_ptr() != slot.data_ptr():
            slot.copy_(value)
        return slot

    def holds(self, t: torch.Tensor) -> bool:
        begin = self.buffer.data_ptr()
        return t.device.type == "cpu" and begin <= t.data_ptr() < begin + self.buffer.numel()


def module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) of `model` by its qualified name."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def set_module_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer `name` of `model` by `value` (a parameter stays a parameter; a
    `nn.Parameter` value is taken as it is, so one object can fill two tied names)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if leaf in owner._parameters:
        owner._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def pack_weights(model: nn.Module, skip=lambda name, t: False) -> WeightArena:
    """Move every CPU parameter and buffer of an inference model (except those `skip(name, tensor)`
    names) into one arena, tensor by tensor, so each old copy is freed as its slot fills; a tensor
    held under two names (tied) gets one slot and stays tied. Values and bits are unchanged. Returns
    the arena (the tensors keep it alive)."""
    groups: dict[int, list[str]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in module_tensors(model).items():
        if t.device.type == "cpu" and t.numel() and not skip(name, t):
            groups.setdefault(id(t), []).append(name)
            tensors.setdefault(groups[id(t)][0], t)
    arena = WeightArena.of(tensors)
    for tied in groups.values():
        old = tensors.pop(tied[0])
        slot = arena.place(tied[0], old)
        if isinstance(old, nn.Parameter):
            slot = nn.Parameter(slot, requires_grad=False)
        del old
        for name in tied:
            set_module_tensor(model, name, slot)
    return arena
