"""Engram table: read-only shared safetensors mapping, sparse row lookup, dequantisation
(docs/ARCHITECTURE.md §9 step 1, docs/CHECKPOINT.md §2 and §7)."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dsv41.model import native
from dsv41.model.engram import EngramTable, map_safetensors_tensor
from dsv41.model.numerics import Numerics

GIB = 1 << 30


def e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float8_e4m3fn).view(torch.uint8)


def dense_rows(weight_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """Independent dequantisation in float64: e4m3 value times 2^(byte - 127) per 32 values."""
    values = weight_u8.view(torch.float8_e4m3fn).to(torch.float64)
    scales = torch.pow(2.0, scale_u8.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    return values * scales


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def mapping_permissions(path) -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[1] for line in f if line.rstrip().endswith(str(path))}


def test_map_matches_safetensors_loader(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w8": torch.randn(5, 64, generator=gen).to(torch.float8_e4m3fn),
        "s8": torch.randint(100, 140, (5, 2), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu),
        "bf": torch.randn(3, 7, generator=gen).to(torch.bfloat16),
        "f32": torch.randn(11, generator=gen),
        "i64": torch.arange(-4, 5, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    reference = load_file(str(path))
    for name in tensors:
        got = map_safetensors_tensor(path, name)
        assert got.dtype == reference[name].dtype and got.shape == reference[name].shape
        assert torch.equal(got.view(torch.uint8), reference[name].view(torch.uint8))
    with pytest.raises(KeyError, match="nope"):
        map_safetensors_tensor(path, "nope")


def test_mapping_is_read_only_and_shared(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"x": torch.arange(100000, dtype=torch.int32)}, str(path))
    x = map_safetensors_tensor(path, "x")
    assert int(x[77777]) == 77777
    assert mapping_permissions(path) == {"r--s"}  # PROT_READ, MAP_SHARED: never copy-on-write
    del x


def test_truncated_file_is_detected(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"x": torch.zeros(1000)}, str(path))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 8)
    with pytest.raises(ValueError, match="truncated"):
        map_safetensors_tensor(path, "x")


def write_sparse_table(path, rows: int, head_dim: int, real_rows: dict[int, tuple[torch.Tensor, torch.Tensor]]):
    """A safetensors table file of `rows` rows in which only `real_rows` hold data (the rest are holes)."""
    w_bytes, s_bytes = rows * head_dim, rows * head_dim // 32
    header = {"embed.weight": {"dtype": "F8_E4M3", "shape": [rows, head_dim], "data_offsets": [0, w_bytes]},
              "embed.scale": {"dtype": "F8_E8M0", "shape": [rows, head_dim // 32],
                              "data_offsets": [w_bytes, w_bytes + s_bytes]}}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    start = 8 + len(blob)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(start + w_bytes + s_bytes)
        for r, (w, s) in real_rows.items():
            f.seek(start + r * head_dim)
            f.write(w.numpy().tobytes())
            f.seek(start + w_bytes + r * (head_dim // 32))
            f.write(s.numpy().tobytes())
    return start + w_bytes + s_bytes


def test_sparse_table_larger_than_budget(tmp_path):
    rows, De = 24 * (1 << 20), 256  # 6.2 GiB of table: far more than this test may touch
    gen = torch.Generator().manual_seed(1)
    picks = [0, 1, 4097, 12_345_677, rows // 2 + 3, rows - 1]
    real = {r: (e4m3_bytes(torch.randn(De, generator=gen) * 8),
                torch.randint(110, 140, (De // 32,), dtype=torch.uint8, generator=gen)) for r in picks}
    path = tmp_path / "engram.safetensors"
    size = write_sparse_table(path, rows, De, real)
    assert size > 6 * GIB and path.stat().st_blocks * 512 < 64 << 20  # sparse on disk

    before = rss_bytes()
    table = EngramTable.from_safetensors(path, "embed.weight", "embed.scale")
    assert table.weight.shape == (rows, De) and table.weight.dtype == torch.float8_e4m3fn
    assert table.scale.shape == (rows, De // 32) and table.scale.dtype == torch.float8_e8m0fnu
    ids = torch.tensor([[picks[3], picks[0], picks[5]], [picks[1], picks[2], picks[4]], [7, 8, 9]])
    got = table.lookup(ids)
    grown = rss_bytes() - before
    assert got.shape == (3, 3, De) and got.dtype == torch.bfloat16
    for r, row in zip(ids.flatten().tolist(), got.reshape(-1, De)):
        w, s = real.get(r, (torch.zeros(De, dtype=torch.uint8), torch.zeros(De // 32, dtype=torch.uint8)))
        assert torch.equal(row, dense_rows(w, s).to(torch.bfloat16))
    assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.1f} MiB for a {size / GIB:.1f} GiB table"
    assert mapping_permissions(path) == {"r--s"}

    # A mapped table is pinned where it is: moving the model neither copies nor converts it.
    model = nn.Sequential(table)
    ptr = table.weight.data_ptr()
    model.to(torch.bfloat16)
    assert table.weight.dtype == torch.float8_e4m3fn and table.weight.data_ptr() == ptr
    # Loading into the read-only mapping is refused with a message (a copy would fault).
    small = {"0.weight": torch.zeros(rows, De, dtype=torch.float8_e4m3fn, device="meta"),
             "0.scale": torch.zeros(rows, De // 32, dtype=torch.float8_e8m0fnu, device="meta")}
    with pytest.raises(RuntimeError, match="read-only file mapping"):
        model.load_state_dict(small)


def test_lookup_matches_dense_dequantisation():
    gen = torch.Generator().manual_seed(2)
    rows, De = 97, 64
    table = EngramTable(rows, De)
    w = e4m3_bytes(torch.randn(rows, De, generator=gen) * 30)
    s = torch.randint(0, 255, (rows, De // 32), dtype=torch.uint8, generator=gen)  # all finite scales
    table.weight.data.copy_(w.view(torch.float8_e4m3fn))
    table.scale.data.copy_(s.view(torch.float8_e8m0fnu))
    ids = torch.randint(0, rows, (2, 5, 3), generator=gen)
    got = table.lookup(ids)
    assert got.shape == (2, 5, 3, De)
    expected = dense_rows(w, s)[ids].to(torch.bfloat16)
    assert torch.equal(got, expected)


def test_movable_table_follows_the_model():
    table = EngramTable(4, 32)
    assert table.movable
    nn.Sequential(table).to(torch.device("meta"))
    assert table.weight.device.type == "meta"


def test_attach_checks_shapes():
    table = EngramTable(4, 64, device="meta")
    with pytest.raises(ValueError, match="weight"):
        table.attach(torch.zeros(4, 32, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.float8_e8m0fnu))


needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler for the native kernels")


def every_byte_pair_table() -> EngramTable:
    """256 rows of all 256 weight bytes, row r scaled by ue8m0 byte r throughout: every pair once."""
    table = EngramTable(256, 256)
    table.weight.data.view(torch.uint8).copy_(torch.arange(256, dtype=torch.uint8).repeat(256, 1))
    table.scale.data.view(torch.uint8).copy_(torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 8))
    return table


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, any NaN equal to any NaN (the payload of a NaN is not kept)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


@needs_native
def test_the_native_lookup_gives_the_torch_paths_values_for_every_byte_pair(monkeypatch):
    table, policy = every_byte_pair_table(), Numerics.for_device("fast", None, "cpu")
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(4)).view(4, 2, 32)
    want = table.lookup(ids)
    got = table.lookup(ids, numerics=policy)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and same_values(got, want)
    finite = ~want.isnan()
    expected = dense_rows(table.weight.view(torch.uint8)[ids], table.scale.view(torch.uint8)[ids])
    assert torch.equal(got[finite].double(), expected.to(torch.bfloat16).double()[finite])
    # the policy's call is the kernel's: planted, it is seen
    monkeypatch.setattr(native, "engram_rows", lambda *args: torch.zeros(()))
    assert table.lookup(ids, numerics=policy).shape == ()
    assert same_values(table.lookup(ids, numerics=Numerics("fast", "blas")), want)     # no native kernels


@needs_native
def test_the_native_lookup_of_a_table_part_reads_zeros_outside_it():
    whole = every_byte_pair_table()
    part = EngramTable(256, 256, part=(96, 160))
    part.weight.data.copy_(whole.weight.data[96:160])
    part.scale.data.copy_(whole.scale.data[96:160])
    ids = torch.arange(0, 255, 3).view(1, 17, 5)
    got = part.lookup(ids, numerics=Numerics.for_device("reference", None, "cpu"))
    assert same_values(got, part.lookup(ids))
    inside = (ids >= 96) & (ids < 160)
    assert not got[~inside].any() and same_values(got[inside], whole.lookup(ids)[inside])
