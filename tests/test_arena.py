"""A CPU model's weights in one huge-page arena (docs/NUMERICS.md N32).

Expectations: a loaded model's tensors all lie in one buffer advised for huge pages (the kernel's own
record of the mapping, /proc/self/smaps, says so), hold the bits of a load without it in every held
form (quantised, dequantised to bf16, stored fp4 experts), Engram tables kept on disk stay mapped, and
`pack_weights` moves an in-process model without changing a bit or untying a tied tensor.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from dsv41.checkpoint.model_io import load_model
from dsv41.config import RuntimeConfig
from dsv41.model import arena as arena_module
from dsv41.model.arena import SLOT_ALIGN, WeightArena, module_tensors, pack_weights

from helpers import MAX_SEQ, binding_config, build, token_ids, without_dspark
from test_model_io import saved  # noqa: F401  (the sharded checkpoint fixture)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")


def _span(tensors) -> tuple[int, int]:
    """(bytes from the first tensor's start to the last one's end, bytes the tensors hold)."""
    ends = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()]
    return max(e for _, e in ends) - min(b for b, _ in ends), sum(e - b for b, e in ends)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address`, from the kernel's /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(x, 16) for x in head.split("-"))
            inside = begin <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("runtime", [dict(), dict(numerics="fast"), dict(numerics="fast", stored_experts=True),
                                     dict(numerics="fast", dtype="float32")],
                         ids=["reference", "fast-bf16", "fast-stored", "fast-fp32"])
def test_loaded_weights_fill_one_arena_with_the_bits_of_a_plain_load(saved, runtime):
    _, directory = saved
    packed = load_model(directory, RuntimeConfig(max_seq_len=MAX_SEQ, **runtime))
    plain = load_model(directory, RuntimeConfig(max_seq_len=MAX_SEQ, huge_pages=False, **runtime))
    a, b = packed.state_dict(), plain.state_dict()
    span, held = _span(a.values())
    # one buffer: the slots' padding (at most SLOT_ALIGN each) is all that lies between the tensors
    assert held <= span <= held + SLOT_ALIGN * len(a)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    ids = token_ids(2, 10)
    run = lambda m: m.logits(m(ids, 0, m.new_cache(2, MAX_SEQ)).hidden)
    assert torch.equal(run(packed), run(plain))


@linux_only
def test_the_arena_is_advised_for_huge_pages(saved, monkeypatch):
    _, directory = saved
    model = load_model(directory, RuntimeConfig(max_seq_len=MAX_SEQ))
    weight = model.layers[0].ffn.experts.w1.weight
    assert "hg" in _vm_flags(weight.data_ptr())
    # Without huge pages nothing is advised. The flags of the memory a plain load gets cannot say so: the
    # allocator may hand it heap memory that an earlier arena advised and freed (seen in a full run).
    asked = []
    advise = arena_module.advise_huge_pages
    monkeypatch.setattr(arena_module, "advise_huge_pages", lambda *a: asked.append(a) or advise(*a))
    load_model(directory, RuntimeConfig(max_seq_len=MAX_SEQ, huge_pages=False))
    assert asked == []
    load_model(directory, RuntimeConfig(max_seq_len=MAX_SEQ))
    assert asked                                   # the same watch sees a packed load ask


def test_engram_tables_on_disk_stay_mapped_outside_the_arena(demo_dir):
    model = load_model(demo_dir, RuntimeConfig(max_seq_len=64), engram_on_disk=True)
    tables = {name: t for name, t in model.state_dict().items() if ".engram.embed." in name}
    rest = [t for name, t in model.state_dict().items() if name not in tables]
    assert tables
    span, held = _span(rest)
    assert held <= span <= held + SLOT_ALIGN * len(rest)
    lo, hi = min(t.data_ptr() for t in rest), max(t.data_ptr() for t in rest)
    assert all(not lo <= t.data_ptr() <= hi for t in tables.values())


def test_pack_weights_keeps_every_bit_and_every_tie():
    model = build(without_dspark(binding_config()), "fast")
    shared = nn.Parameter(torch.randn(3, 5), requires_grad=False)
    model.tied_a, model.tied_b = nn.Module(), nn.Module()
    model.tied_a.weight = model.tied_b.weight = shared
    before = {name: t.clone() for name, t in module_tensors(model).items()}
    ids = token_ids(1, 9)
    run = lambda: model.logits(model(ids, 0, model.new_cache(1, MAX_SEQ)).hidden)
    expected = run()
    arena = pack_weights(model)
    after = module_tensors(model)
    assert after.keys() == before.keys()
    for name, t in after.items():
        assert arena.holds(t), name
        assert torch.equal(t, before[name]), name
    assert model.tied_a.weight is model.tied_b.weight
    assert torch.equal(run(), expected)


def test_slots_are_aligned_apart_and_only_take_their_own_shape():
    arena = WeightArena({"a": ((3, 7), torch.bfloat16), "b": ((5,), torch.float32), "c": ((2, 2), torch.int8)})
    slots = {name: arena.slot(name) for name in "abc"}
    assert all(s.data_ptr() % SLOT_ALIGN == 0 for s in slots.values())
    assert slots["b"].data_ptr() - slots["a"].data_ptr() >= 3 * 7 * 2
    value = torch.arange(5, dtype=torch.float32)
    placed = arena.place("b", value)
    assert placed.data_ptr() == slots["b"].data_ptr() and torch.equal(placed, value)
    odd = torch.zeros(4, dtype=torch.float32)
    assert arena.place("b", odd) is odd and arena.place("unknown", odd) is odd
    assert arena.slot("unknown") is None
