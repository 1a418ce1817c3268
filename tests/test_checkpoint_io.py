"""Writing and reading safetensors checkpoints: round trips, slicing, and directory validation."""

import json
import os
import struct

import pytest
import torch

from dsv41.checkpoint import (INDEX_NAME, CheckpointDir, CheckpointError, TensorSpec, byte_progress, read_header,
                              save_checkpoint)

ALL_DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8,
              torch.uint8, torch.float16, torch.int64]


def random_bits(dtype, shape, seed=0):
    """Every bit pattern is fair game (NaNs included): the round trip must be bit-exact."""
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).reshape(shape)


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.contiguous()), bits(b.contiguous()))


@pytest.fixture()
def tensors():
    out = {f"t.{i}.{str(d).split('.')[-1]}": random_bits(d, (3 + i, 5 + 2 * i), seed=i)
           for i, d in enumerate(ALL_DTYPES)}
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    out["transposed"] = random_bits(torch.float32, (6, 4), seed=99).t()  # non-contiguous input
    return out


@pytest.fixture()
def saved(tmp_path, tensors):
    save_checkpoint(tmp_path, tensors, max_shard_bytes=128)
    return tmp_path


def test_round_trip_is_bit_identical_for_every_dtype(saved, tensors):
    ckpt = CheckpointDir(saved)
    assert ckpt.names() == list(tensors)
    for name, t in tensors.items():
        assert same_bits(ckpt.tensor(name), t), name
        assert ckpt.spec(name).shape == tuple(t.shape)
    assert ckpt.spec("t.3.float8_e8m0fnu").dtype == "F8_E8M0"
    assert ckpt.spec("t.2.float8_e4m3fn").dtype == "F8_E4M3"
    assert ckpt.spec("t.4.int8").dtype == "I8"


def test_index_and_shard_names(saved, tensors):
    index = json.loads((saved / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(saved)) == sorted(files + [INDEX_NAME])  # no temporary files left


def test_shards_follow_the_given_order(tmp_path):
    sizes = {"a": 60, "b": 60, "c": 30, "d": 200, "e": 10}
    save_checkpoint(tmp_path, [(k, torch.zeros(v, dtype=torch.uint8)) for k, v in sizes.items()],
                    max_shard_bytes=100, metadata={"format": "pt"})
    weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    groups = {}
    for name, file in weight_map.items():
        groups.setdefault(file, []).append(name)
    assert [groups[f] for f in sorted(groups)] == [["a"], ["b", "c"], ["d"], ["e"]]
    assert CheckpointDir(tmp_path).shard_metadata[sorted(groups)[0]] == {"format": "pt"}


def test_files_are_read_by_the_safetensors_library(saved, tensors):
    safetensors = pytest.importorskip("safetensors")
    ckpt = CheckpointDir(saved)
    for name, t in tensors.items():
        with safetensors.safe_open(ckpt.file_of(name), framework="pt") as f:
            assert same_bits(f.get_tensor(name), t), name


def test_reads_a_library_written_single_file(tmp_path, tensors):
    st = pytest.importorskip("safetensors.torch")
    st.save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    ckpt = CheckpointDir(tmp_path)
    assert sorted(ckpt.names()) == sorted(tensors)
    for name, t in tensors.items():
        assert same_bits(ckpt.tensor(name), t), name


def test_tensor_data_is_aligned_and_mapped(saved, tensors):
    ckpt = CheckpointDir(saved)
    for name in tensors:
        header = read_header(ckpt.file_of(name))
        stored = header.tensors[name]
        assert stored.begin % max(1, tensors[name].element_size()) == 0
    full = ckpt.tensor("t.1.float32")
    again = ckpt.tensor("t.1.float32")
    assert full.data_ptr() == again.data_ptr()  # both views of the one mapping, not copies


def test_sliced_reads(saved, tensors):
    ckpt = CheckpointDir(saved)
    name = "t.0.bfloat16"
    full, ref = ckpt.tensor(name), tensors[name]
    rows = ckpt.tensor(name, slice_dim=0, start=1, stop=3)
    assert same_bits(rows, ref[1:3])
    assert rows.data_ptr() == full[1:3].data_ptr()  # a view into the mapping
    cols = ckpt.tensor(name, slice_dim=1, start=2, stop=4)
    assert same_bits(cols, ref[:, 2:4]) and cols.is_contiguous()
    assert cols.untyped_storage().nbytes() == cols.numel() * cols.element_size()  # only the slice was copied
    assert same_bits(ckpt.tensor(name, slice_dim=-1, start=3), ref[:, 3:])
    scales = ckpt.tensor("t.3.float8_e8m0fnu", slice_dim=1, start=0, stop=1)
    assert same_bits(scales, tensors["t.3.float8_e8m0fnu"][:, :1])
    with pytest.raises(ValueError, match="outside"):
        ckpt.tensor(name, slice_dim=0, start=2, stop=99)
    with pytest.raises(KeyError, match="nope"):
        ckpt.tensor("nope")


# ---------------------------------------------------------------------------------------- validation
def _index(directory):
    return json.loads((directory / INDEX_NAME).read_text())


def test_missing_shard_is_named(saved):
    victim = sorted(set(_index(saved)["weight_map"].values()))[1]
    (saved / victim).unlink()
    with pytest.raises(CheckpointError, match=victim):
        CheckpointDir(saved)


def test_truncated_shard_is_named(saved):
    victim = sorted(set(_index(saved)["weight_map"].values()))[-1]
    size = (saved / victim).stat().st_size
    os.truncate(saved / victim, size - 1)
    with pytest.raises(CheckpointError, match=f"{victim} is truncated"):
        CheckpointDir(saved)


def test_truncated_header_is_named(saved):
    victim = sorted(set(_index(saved)["weight_map"].values()))[0]
    os.truncate(saved / victim, 12)
    with pytest.raises(CheckpointError, match=f"{victim} is truncated"):
        CheckpointDir(saved)


def test_index_entry_pointing_at_the_wrong_file(saved):
    index = _index(saved)
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    (saved / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{name} \(index says {files[1]}\)"):
        CheckpointDir(saved)


def test_bad_index_json(saved):
    (saved / INDEX_NAME).write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match=rf"{INDEX_NAME}: not valid JSON"):
        CheckpointDir(saved)


def test_index_without_weight_map_or_escaping_the_directory(saved):
    (saved / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointDir(saved)
    (saved / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="elsewhere"):
        CheckpointDir(saved)


def test_bad_shard_header(tmp_path):
    body = b"{not json"
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CheckpointError, match="model.safetensors: header is not valid JSON"):
        CheckpointDir(tmp_path)
    body = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + bytes(8))
    with pytest.raises(CheckpointError, match="tensor w covers 8 bytes"):
        CheckpointDir(tmp_path)


def test_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        CheckpointDir(tmp_path)


def test_validate_against_lists_every_kind_of_mismatch(saved, tensors):
    ckpt = CheckpointDir(saved)
    expected = {n: ckpt.spec(n) for n in ckpt.names()}
    expected.pop("scalar")                                                  # unexpected in the checkpoint
    for i in range(7):
        expected[f"extra.{i}"] = TensorSpec(f"extra.{i}", "BF16", (1,))     # missing from it
    expected["t.0.bfloat16"] = TensorSpec("t.0.bfloat16", "BF16", (9, 9))   # mis-shaped
    expected["t.1.float32"] = TensorSpec("t.1.float32", "BF16", (4, 7))     # mis-typed
    with pytest.raises(CheckpointError) as info:
        ckpt.validate_against(expected)
    message = str(info.value)
    assert "7 missing, 1 unexpected, 1 mis-shaped, 1 mis-typed" in message
    assert "extra.0" in message and "(2 more)" in message
    assert "scalar" in message and "t.0.bfloat16 is (3, 5), expected (9, 9)" in message
    assert "t.1.float32 is F32, expected BF16" in message
    assert len(info.value.missing) == 7
    ckpt.validate_against({n: ckpt.spec(n) for n in ckpt.names()})  # an exact match passes


# ---------------------------------------------------------------------------------------- writer safety
def test_failed_save_leaves_the_previous_checkpoint_intact(saved, tensors):
    before = sorted(os.listdir(saved))

    def exploding():
        yield "a", torch.zeros(200, dtype=torch.uint8)
        yield "b", torch.zeros(200, dtype=torch.uint8)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        save_checkpoint(saved, exploding(), max_shard_bytes=100)
    assert sorted(os.listdir(saved)) == before  # temporaries removed, old shards and index untouched
    assert same_bits(CheckpointDir(saved).tensor("t.0.bfloat16"), tensors["t.0.bfloat16"])


def test_resave_replaces_the_old_checkpoint(saved):
    save_checkpoint(saved, {"only": torch.arange(4)})
    assert sorted(os.listdir(saved)) == ["model-00001-of-00001.safetensors", INDEX_NAME]
    assert torch.equal(CheckpointDir(saved).tensor("only"), torch.arange(4))


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        save_checkpoint(tmp_path, [("x", torch.zeros(1)), ("x", torch.zeros(1))])
    with pytest.raises(ValueError, match="safetensors dtype"):
        save_checkpoint(tmp_path, {"c": torch.zeros(2, dtype=torch.complex64)})
    assert not (tmp_path / INDEX_NAME).exists() and os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------- larger than RAM
def test_table_larger_than_memory_is_mapped_not_copied(tmp_path):
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows, width = (ram + 2**30) // 256 + 1, 256  # one F8_E4M3 table bigger than physical memory
    body = json.dumps({"table": {"dtype": "F8_E4M3", "shape": [rows, width], "data_offsets": [0, rows * width]}})
    body = body.encode() + b" " * (-len(body) % 8)
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
        f.truncate(8 + len(body) + rows * width)  # sparse: costs no disk
        f.seek(8 + len(body) + (rows - 1) * width)
        f.write(bytes(range(256)))
    if os.stat(path).st_blocks * 512 > 2**30:
        pytest.skip("filesystem does not support sparse files")
    try:
        ckpt = CheckpointDir(tmp_path)
        last = ckpt.tensor("table", slice_dim=0, start=rows - 2, stop=rows)
        assert last.dtype == torch.float8_e4m3fn and last.shape == (2, 256)
        assert torch.equal(last.view(torch.uint8)[1], torch.arange(256, dtype=torch.uint8))
        assert not last.view(torch.uint8)[0].any()
    finally:
        path.unlink()  # pytest keeps recent tmp dirs; do not leave a file the size of RAM behind


def test_progress_is_silent_without_a_terminal():
    with byte_progress(10, "x") as bar:  # pytest captures stderr, so it is not a tty
        assert bar.disable
    with byte_progress(10, "x", enabled=True) as bar:
        assert not bar.disable
