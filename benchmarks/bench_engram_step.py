"""Is a decode step's Engram cost hidden behind the blocks before its layer? One model, its two Engram
tables held three ways, decode steps alternating in one run:

- in RAM (gathered at once, in the step);
- memory-mapped from a safetensors file with their pages resident (gathered on the model's
  background thread while the blocks before the Engram layer run, as `engram_on_disk` loads them);
- memory-mapped with every page evicted before each step (madvise + posix_fadvise DONTNEED), so each
  row is read from the file again: gathered in the background (as dsv41 runs), and, to see what the
  overlap hides, gathered in the step (the table marked movable for that variant only).

Printed: each variant's median step, a step's gathers alone (evicted and resident), and the share
of the evicted gathers' cost the background gather hides. The file holds real bytes (not a sparse
file), so an evicted read goes to the disk (or the host's cache beneath a VM).

    python benchmarks/bench_engram_step.py [--dim 512] [--layers 8] [--rows 1000000] [--batch 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_reference import config                 # noqa: E402
from dsv41.config import ModelConfig, RuntimeConfig          # noqa: E402
from dsv41.model import Transformer                          # noqa: E402
from dsv41.model.engram import EngramTable                   # noqa: E402
from dsv41.model.engram.hashing import table_rows            # noqa: E402
from dsv41.model.init import init_random_                    # noqa: E402

MADV_DONTNEED = 4
PAGE = os.sysconf("SC_PAGE_SIZE")


def engram_config(dim: int, layers: int, rows: int) -> ModelConfig:
    """bench_reference's config with two Engram layers (1, as in the release, and one past the middle)
    of about `rows` rows each, at the release's head count and row width."""
    heads, orders = 8, 3
    vocab = rows // (heads * orders)
    ids = (1, max(2, layers * 2 // 3))
    return config(dim, layers).replace(
        engram_layer_ids=ids, engram_vocab_size=vocab, engram_max_ngram_size=orders + 1, engram_pad_id=2,
        engram_compressed_vocab_size=4096, engram_n_heads=heads, engram_head_dim=256,
        engram_num_embeddings=table_rows(len(ids), orders + 1, heads, vocab))


def write_tables(path: Path, tables: list[EngramTable]) -> None:
    """The tables' bytes into one safetensors file, as `t{i}.weight` / `t{i}.scale`."""
    header, offset, blobs = {}, 0, []
    for i, table in enumerate(tables):
        for name, t, dtype in (("weight", table.weight, "F8_E4M3"), ("scale", table.scale, "F8_E8M0")):
            data = t.detach().view(torch.uint8).contiguous().numpy().tobytes()
            header[f"t{i}.{name}"] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
            offset += len(data)
            blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def evict(path: Path, tables: list[EngramTable]) -> None:
    """Drop the mapped tables' pages from this process and from the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for table in tables:
        for t in (table.weight, table.scale):
            start = t.data_ptr() - t.data_ptr() % PAGE
            length = t.data_ptr() + t.numel() * t.element_size() - start
            if libc.madvise(start, length, MADV_DONTNEED):
                raise OSError(ctypes.get_errno(), "madvise")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of each Engram table (about)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tmp", type=Path, default=None, help="directory for the table file (default: the system's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = engram_config(args.dim, args.layers, args.rows)
    length = args.prompt + args.steps + 1
    runtime = RuntimeConfig(max_seq_len=length, max_batch_size=args.batch, numerics="fast", dtype="bfloat16")
    model = init_random_(Transformer(cfg, runtime), 0)
    model.set_token_map(torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size)
    blocks = [b for b in model.layers if b.engram is not None]
    in_ram = [b.engram.embed for b in blocks]
    ids = torch.randint(0, cfg.vocab_size, (args.batch, length), generator=torch.Generator().manual_seed(1))
    mb = sum(t.weight.numel() + t.scale.numel() for t in in_ram) / 1e6
    print(f"dim {args.dim}, {args.layers} layers, Engram layers {list(cfg.engram_layer_ids)} of "
          f"{list(cfg.engram_num_embeddings)} rows ({mb:.0f} MB), batch {args.batch}, {args.threads} threads, "
          f"fast bf16")

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        path, warm_path = Path(tmp) / "engram.safetensors", Path(tmp) / "engram_resident.safetensors"
        for p in (path, warm_path):       # two files: evicting one must not evict the resident variant's pages
            write_tables(p, in_ram)
        mapped, resident = ([EngramTable.from_safetensors(p, f"t{i}.weight", f"t{i}.scale")
                             for i in range(len(blocks))] for p in (path, warm_path))
        for table in resident:            # every page read once, so its rows are in the page tables
            for t in (table.weight, table.scale):
                t.view(torch.uint8).flatten().sum(dtype=torch.int64)
        variants = {"RAM": (in_ram, False, False), "mapped, resident, ahead": (resident, False, False),
                    "mapped, evicted, ahead": (mapped, True, False), "mapped, evicted, in step": (mapped, True, True)}

        def use(tables, inline: bool) -> None:
            for block, table in zip(blocks, tables):
                block.engram.embed = table
                table.movable = inline or table is in_ram[blocks.index(block)]

        caches = {name: model.new_cache(args.batch, length) for name in variants}
        times: dict[str, list[float]] = {name: [] for name in variants}
        last = {}
        with torch.no_grad():
            for name, (tables, _, inline) in variants.items():
                use(tables, inline)
                model(ids[:, :args.prompt], 0, caches[name])
            for pos in range(args.prompt, length - 1):
                for name, (tables, cold, inline) in variants.items():
                    use(tables, inline)
                    if cold:
                        evict(path, mapped)
                    start = time.perf_counter()
                    last[name] = model.logits(model(ids[:, pos:pos + 1], pos, caches[name]).hidden[:, -1])
                    times[name].append(time.perf_counter() - start)
            same = all(torch.equal(last["RAM"], out) for out in last.values())
            hash_ids = torch.randint(0, min(cfg.engram_num_embeddings), (args.batch, 1, cfg.engram_hash_columns),
                                     generator=torch.Generator().manual_seed(2))
            gathers: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.steps):
                for cold in (True, False):
                    if cold:
                        evict(path, mapped)
                    start = time.perf_counter()
                    for table in mapped if cold else resident:
                        table.lookup(hash_ids)
                    gathers[cold].append(time.perf_counter() - start)
        use(in_ram, False)
        del mapped, resident, variants

    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, ms in med.items():
        print(f"  {name:<26} {ms:8.2f} ms/step  (median of {len(times[name])})")
    cold, warm = (statistics.median(gathers[c]) * 1e3 for c in (True, False))
    rows = len(blocks) * args.batch * cfg.engram_hash_columns
    print(f"  a step's gathers alone     {cold:8.2f} ms evicted, {warm:.3f} ms resident ({rows} rows)")
    exposed_in_step = med["mapped, evicted, in step"] - med["RAM"]
    exposed_ahead = med["mapped, evicted, ahead"] - med["RAM"]
    print(f"exposed Engram read cost: in the step {exposed_in_step:.2f} ms, gathered ahead {exposed_ahead:.2f} ms"
          + (f" (hidden: {1 - exposed_ahead / exposed_in_step:.0%})" if exposed_in_step > 0 else ""))
    print(f"last logits equal across the variants: {same}")


if __name__ == "__main__":
    main()
