"""`dsv41 check` and the load plan: validation without loading, on a sparse replica of the release.

The replica has the released config, the released layout's 96,085 names, dtypes and shapes in 48 shard
headers (placed as docs/CHECKPOINT.md §1 reports), an index with the real `total_size` — and no data: each
shard is a sparse file whose data region is a hole, so 475 GiB cost no disk.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from dataclasses import replace
from pathlib import Path

import pytest

import dsv41
import helpers
from dsv41 import cli
from dsv41.checkpoint.inventory import released_inventory
from dsv41.checkpoint.plan import (PlanError, cache_bytes, check_context, check_fits, context_limit, fmt_bytes,
                                   meta_model, plan_load)
from dsv41.checkpoint.safetensors_io import CheckpointDir
from dsv41.config import ModelConfig, RuntimeConfig
from dsv41.errors import UserError
from dsv41.tokenizer import Tokenizer

RELEASED_TOTAL = 510_286_023_000        # the index's total_size (docs/CHECKPOINT.md §1)
GIB = 2 ** 30


def _shard_of(name: str, n_layers: int) -> int:
    """Placement of docs/CHECKPOINT.md §1: vision, embed, one layer per shard, head, DSpark, Engram tables."""
    if name.startswith(("vision.", "aligner.")):
        return 1
    if name.startswith(("embed.", "image_")):
        return 2
    if ".engram." in name:
        return 47 if name.startswith("layers.1.") else 48
    if name.startswith("layers."):
        return 3 + int(name.split(".")[1])
    if name.startswith("mtp."):
        return 3 + n_layers + 1 + int(name.split(".")[1])
    return 3 + n_layers                                       # head, norm, hc_head


def write_sparse_replica(cfg_json: Path, tokenizer_dir: Path, directory: Path, *, drop: str | None = None,
                         total_size: int | None = None, truncate: str | None = None) -> Path:
    """Headers and index of the released layout with hole-filled data regions (see the module doc)."""
    directory.mkdir(parents=True)
    cfg = ModelConfig.from_json(cfg_json)
    shutil.copyfile(cfg_json, directory / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    files: dict[int, list] = {}
    for spec in released_inventory(cfg).values():
        if spec.name != drop:
            files.setdefault(_shard_of(spec.name, cfg.n_layers), []).append(spec)
    weight_map, total = {}, 0
    for index, specs in sorted(files.items()):
        file = f"model-{index:05d}-of-00048.safetensors"
        header, offset = {}, 0
        for spec in specs:
            header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
            weight_map[spec.name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(directory / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset - (1 if file == truncate else 0))
        total += offset
    index = {"metadata": {"total_size": total if total_size is None else total_size}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


@pytest.fixture(scope="module")
def replica_source(demo_dir, tmp_path_factory):
    """The released config with the demo's tokenizer and its Engram key count (the released tokenizer.json
    is not shipped); every shape stays the release's."""
    tokenizer = Tokenizer.from_dir(demo_dir)
    keys = ModelConfig.from_json(demo_dir / "config.json").engram_compressed_vocab_size
    raw = json.loads((Path(dsv41.__file__).parent / "configs" / "deepseek-v4.1-flash.json").read_text())
    raw["engram_compressed_vocab_size"] = keys
    assert tokenizer.vocab_size <= raw["vocab_size"]
    path = tmp_path_factory.mktemp("released-config") / "config.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def replica(replica_source, demo_dir, tmp_path_factory):
    return write_sparse_replica(replica_source, demo_dir, tmp_path_factory.mktemp("replica") / "flash")


def test_replica_really_is_the_released_layout(replica):
    ckpt = CheckpointDir(replica)
    assert len(ckpt) == 96_085                               # every family, vision included
    assert ckpt.total_bytes == RELEASED_TOTAL
    assert len({ckpt.file_of(n) for n in ckpt.names()}) == 48
    assert sum(f.stat().st_blocks for f in replica.glob("*.safetensors")) * 512 < 200 * 2 ** 20   # holes


def test_check_passes_the_released_layout_in_seconds_and_prints_every_plan(replica, capsys):
    start = time.perf_counter()
    assert cli.main(["check", str(replica)]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "OK" in out.splitlines()[0]
    assert "96,085 tensors, 475.24 GiB in 48 file(s)" in out
    assert "context limit 1,048,576 (original_seq_len 65,536 × rope_factor 16)" in out
    rows = [line.split() for line in out.splitlines() if line.split()[1:2] in (["reference"], ["fast"])]
    assert [(r[0], r[1]) for r in rows] == [(str(ws), n) for n in ("reference", "fast") for ws in (1, 2, 4, 8)]
    assert elapsed < 60                                        # seconds, not a read of 475 GiB


def test_check_collects_every_problem(replica_source, demo_dir, tmp_path, capsys):
    broken = write_sparse_replica(replica_source, demo_dir, tmp_path / "broken", drop="layers.7.attn.wkv.weight",
                                  total_size=RELEASED_TOTAL + 1)
    assert cli.main(["check", str(broken)]) == 2
    out = capsys.readouterr().out
    assert "2 problem(s)" in out.splitlines()[0]
    assert "layers.7.attn.wkv.weight" in out and "total_size is 510,286,023,001" in out


def test_check_names_a_truncated_shard(replica_source, demo_dir, tmp_path, capsys):
    broken = write_sparse_replica(replica_source, demo_dir, tmp_path / "short",
                                  truncate="model-00010-of-00048.safetensors")
    assert cli.main(["check", str(broken)]) == 2
    out = capsys.readouterr().out
    assert "model-00010-of-00048.safetensors is truncated" in out


def test_check_reports_a_tokenizer_that_does_not_match(replica_source, demo_dir, tmp_path, capsys):
    raw = json.loads(replica_source.read_text())
    raw["engram_compressed_vocab_size"] = 99092               # the released tokenizer's key count
    source = tmp_path / "config.json"
    source.write_text(json.dumps(raw))
    broken = write_sparse_replica(source, demo_dir, tmp_path / "tok")
    assert cli.main(["check", str(broken)]) == 2
    out = capsys.readouterr().out
    assert "distinct keys" in out and "99092" in out


def test_check_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["check", str(tmp_path / "empty")]) == 2
    assert "config.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- the plan
def test_plan_weights_are_what_the_loaded_model_holds(demo_dir):
    """Independent of the plan's arithmetic: the bytes of every tensor of the really loaded model."""
    for numerics in ("reference", "fast"):
        runtime = RuntimeConfig(numerics=numerics, max_seq_len=512, max_batch_size=2)
        model = dsv41.load(demo_dir, runtime)
        plan = plan_load(model.cfg, runtime)
        assert sum(plan.weights.values()) == sum(t.nbytes for t in model.state_dict().values())
        cache = model.new_cache(2, 512)
        held = sum(t.nbytes for t in [*cache.window.values(), cache.engram_history.ids]
                   + [t for s in cache.sources.values() for t in (s.kv, s.index_keys, s.tail_kv, s.tail_score)
                      if t is not None])
        assert plan.cache == held == cache_bytes(model.cfg, runtime)


def test_plan_per_rank_bytes_are_what_each_rank_loads(tmp_path):
    """At TP = EP = 2 and 4 each rank's loaded model holds the plan's bytes (wo_a dequantised to bf16
    without its scale, the head in fp32, the tensors no file stores), except that the last rank does
    not hold the Engram padding rows the plan reserves (534 rows: 1 pad row at 4 ranks)."""
    from test_checkpoint_forms import ENGRAM
    from test_checkpoint_small import random_tensor

    from dsv41.checkpoint.model_io import load_into
    from dsv41.checkpoint.sharding import engram_rows_per_rank
    from dsv41.checkpoint.writer import save_checkpoint
    from dsv41.model import Transformer
    from dsv41.model.engram.hashing import table_rows
    from dsv41.parallel import ParallelContext
    engram = {**ENGRAM, "engram_vocab_size": 114, "engram_num_embeddings": table_rows(1, 3, 2, 114)}   # 534 rows
    cfg = helpers.binding_config(**engram, o_groups=4, index_n_heads=4)      # world sizes 1, 2, 4
    inventory = released_inventory(cfg)
    save_checkpoint(tmp_path, {n: random_tensor(spec, i) for i, (n, spec) in enumerate(inventory.items())})
    runtime = RuntimeConfig(max_seq_len=64)
    ckpt = CheckpointDir(tmp_path)
    row_bytes = sum(t[0].nbytes for n, t in meta_model(cfg, runtime).state_dict().items() if ".engram.embed." in n)
    for ws in (2, 4):
        plan = plan_load(cfg, runtime, world_size=ws)
        _, pad = engram_rows_per_rank(534, ws)
        for rank in range(ws):
            model = Transformer(cfg, runtime, device="meta", parallel=ParallelContext(rank=rank, world_size=ws,
                                                                                      tp_size=ws, ep_size=ws))
            load_into(model, ckpt)
            held = sum(t.nbytes for t in model.state_dict().values())
            unheld = pad * row_bytes if rank == ws - 1 else 0
            assert sum(plan.weights.values()) == held + unheld, (ws, rank)


def test_released_plan_matches_the_published_figures(released_cfg):
    runtime = RuntimeConfig(max_seq_len=65536)
    model = meta_model(released_cfg, runtime)
    plan = plan_load(released_cfg, runtime, model=model)
    assert plan.weights["routed experts"] / GIB == pytest.approx(268.95, abs=0.01)   # docs/CHECKPOINT.md §4
    assert plan.engram / GIB == pytest.approx(188.83, abs=0.01)
    # the ViT and aligner in bf16 (docs/CHECKPOINT.md §4: 823,685,120 + 146,821,120 bytes) and the delimiters
    assert plan.weights["vision encoder"] == 823_685_120 + 146_821_120 + 3 * 5120 * 2
    for ws, engram in ((2, 94.4), (4, 47.2), (8, 23.6)):                 # docs/CHECKPOINT.md §6
        assert plan_load(released_cfg, runtime, world_size=ws, model=model).engram / GIB == pytest.approx(engram, abs=0.05)
    # caches: 3,200 B per token of compressed KV and index keys (§6) + the rings + 8 B of Engram history
    ring = 43 * 128 * 512 * 2
    assert plan.cache == pytest.approx(65536 * (3200 + 8) + ring, rel=0.002)


def test_plan_refuses_with_the_numbers_and_what_would_fit(released_cfg):
    runtime = RuntimeConfig(max_seq_len=65536)
    plan = plan_load(released_cfg, runtime)
    with pytest.raises(PlanError) as e:
        check_fits(released_cfg, runtime, plan, available=(24 * GIB, "a 24 GiB host"))
    message = str(e.value)
    assert "24.00 GiB is available (a 24 GiB host)" in message
    assert f"--engram-on-disk would need {fmt_bytes(plan.on_device - plan.engram)}" in message
    assert "even 8 processes (the most the config allows) would need" in message            # the most the config allows


def test_plan_suggests_a_context_that_fits(demo_dir):
    cfg = ModelConfig.from_json(demo_dir / "config.json")
    runtime = RuntimeConfig(max_seq_len=4096, max_batch_size=64)
    plan = plan_load(cfg, runtime)
    free = plan.on_device - plan.cache // 2
    with pytest.raises(PlanError, match="a context of [0-9,]+ would fit") as e:
        check_fits(cfg, runtime, plan, available=(free, "test"))
    fits = int(str(e.value).split("a context of ")[1].split(" would")[0].replace(",", ""))
    smaller = plan_load(cfg, replace(runtime, max_seq_len=fits))
    check_fits(cfg, runtime, smaller, available=(free, "test"))     # the suggestion really fits


def test_context_beyond_the_rope_settings_is_refused(released_cfg, demo_dir, capsys):
    assert context_limit(released_cfg) == 1_048_576
    check_context(released_cfg, 1_048_576)
    with pytest.raises(PlanError, match="1,048,577 positions .* 65,536 × rope_factor 16 = 1,048,576"):
        check_context(released_cfg, 1_048_577)
    assert cli.main(["generate", "--checkpoint", str(demo_dir), "--max-context", "100000000", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rope" in err and "4,096" in err


def test_load_refuses_before_reading_when_memory_is_short(demo_dir, monkeypatch):
    read = []
    monkeypatch.setattr(CheckpointDir, "read", lambda self, *a, **k: read.append(a) or 1 / 0)
    monkeypatch.setenv("DSV41_MEMORY_LIMIT", str(10 * 2 ** 20))
    with pytest.raises(PlanError, match="is available \\(DSV41_MEMORY_LIMIT\\)"):
        dsv41.load(demo_dir, RuntimeConfig(max_seq_len=512))
    assert read == []


def test_a_broken_tokenizer_is_refused_before_any_weight_is_read(demo_dir, tmp_path, monkeypatch):
    copy = tmp_path / "demo"
    shutil.copytree(demo_dir, copy)
    (copy / "tokenizer.json").write_text("{ not json")
    read = []
    monkeypatch.setattr(CheckpointDir, "read", lambda self, *a, **k: read.append(a) or 1 / 0)
    with pytest.raises(UserError, match="tokenizer.json"):
        dsv41.load(copy, RuntimeConfig(max_seq_len=512))
    assert read == []


def test_inspect_never_calls_a_broken_directory_fine(demo_dir, tmp_path, capsys):
    assert cli.main(["inspect", str(demo_dir)]) == 0
    capsys.readouterr()
    copy = tmp_path / "demo"
    shutil.copytree(demo_dir, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    del index["weight_map"]["head.weight"]
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert cli.main(["inspect", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "is not a usable checkpoint" in err and "head.weight" in err


def test_show_plan_prints_it_and_skip_memory_check_loads_anyway(demo_dir, capsys, monkeypatch):
    monkeypatch.setenv("DSV41_CACHE", str(demo_dir.parent))
    monkeypatch.setenv("DSV41_DEMO", "random")
    argv = ["generate", "hi", "--max-new-tokens", "1", "--numerics", "fast", "--show-plan"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "load plan: fast numerics, world size 1, context 4,096" in err and "needed at the peak" in err
    monkeypatch.setenv("DSV41_MEMORY_LIMIT", str(2 ** 20))
    assert cli.main(argv) == 2
    assert "is available (DSV41_MEMORY_LIMIT)" in capsys.readouterr().err
    assert cli.main(argv + ["--skip-memory-check"]) == 0
