"""Engram throughput on this machine: hash ids/s, row gathers from a memory-mapped (sparse) table and
from RAM, and gather-ahead (background thread) vs gather inside the layer.

Run from the repository root: python -m benchmarks.bench_engram [--table-rows N] [--tmp DIR]
The sparse table's holes read as zero pages from the page cache: the gather figure is the mapping's
CPU cost (page faults, copies, dequantisation), an upper bound for a real file on disk.
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dsv41.config import RELEASED_CONFIG, ModelConfig
from dsv41.model.engram import Engram, EngramHistory, EngramLayout, EngramTable, NgramHasher
from dsv41.model.numerics import Numerics

RELEASE = RELEASED_CONFIG
ROW_BYTES = 256 + 8  # e4m3 row plus its 8 ue8m0 scales


def timed(fn, repeat: int) -> float:
    """Best wall time of `repeat` calls, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_hash(cfg: ModelConfig) -> None:
    layout = EngramLayout.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    token_map = torch.cat([torch.arange(99092), torch.randint(0, 99092, (129280 - 99092,), generator=gen)])
    hasher = NgramHasher(layout, token_map)
    B, T = 4, 4096
    tokens = torch.randint(0, 129280, (B, T), generator=gen)
    history = EngramHistory.create(B, T)
    prefill = timed(lambda: hasher(tokens, 0, history), 5)
    ids = B * T * layout.n_layers * layout.n_columns
    print(f"hash prefill  B={B} T={T}: {prefill * 1e3:7.2f} ms  {B * T / prefill / 1e6:6.2f} M positions/s  "
          f"{ids / prefill / 1e6:7.1f} M ids/s")
    step = timed(lambda: hasher(tokens[:, :1], T - 1, history), 50)
    print(f"hash decode   B={B} T=1   : {step * 1e6:7.1f} us per call")


def write_sparse_table(path: Path, rows: int, head_dim: int = 256) -> None:
    w_bytes, s_bytes = rows * head_dim, rows * head_dim // 32
    header = {"w": {"dtype": "F8_E4M3", "shape": [rows, head_dim], "data_offsets": [0, w_bytes]},
              "s": {"dtype": "F8_E8M0", "shape": [rows, head_dim // 32], "data_offsets": [w_bytes, w_bytes + s_bytes]}}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + w_bytes + s_bytes)


def report_gather(label: str, table: EngramTable, ids: torch.Tensor, repeat: int,
                  policy: Numerics | None = None) -> None:
    """`policy`: the lookup a model makes (on the CPU its native one-pass kernel); None: the torch path."""
    n = ids.numel()
    t = timed(lambda: table.lookup(ids, numerics=policy), repeat)
    print(f"{label:<40}: {n / t / 1e6:6.2f} M rows/s  {n * ROW_BYTES / t / 1e6:8.1f} MB/s read  "
          f"({n} rows in {t * 1e3:.1f} ms)")


def bench_gather(rows: int, tmp: Path) -> None:
    path = tmp / "engram_bench.safetensors"
    write_sparse_table(path, rows)
    table = EngramTable.from_safetensors(path, "w", "s")
    gen = torch.Generator().manual_seed(1)
    B, T, N = 4, 512, 24
    print(f"mapped sparse table: {rows} rows, {path.stat().st_size / 2**30:.1f} GiB file")
    first = torch.randint(0, rows, (B, T, N), generator=gen)
    policy = Numerics.for_device("fast", None, "cpu")
    report_gather("mmap gather, first touch", table, first, 1, policy)
    for name, p in (("torch path", None), ("the model's lookup", policy)):
        report_gather(f"mmap gather, pages resident, {name}", table, first, 3, p)
    ram_rows = 1 << 20
    ram = EngramTable(ram_rows, 256)
    ram.weight.data.view(torch.uint8).random_(0, 120, generator=gen)
    ram.scale.data.view(torch.uint8).fill_(127)
    ids = torch.randint(0, ram_rows, (B, T, N), generator=gen)
    step = ids[:1, :1]                                           # a decode step's 24 rows
    for name, p in (("torch path", None), ("the model's lookup", policy)):
        report_gather(f"RAM table (1M rows), {name}", ram, ids, 3, p)
        report_gather(f"RAM table, one decode step, {name}", ram, step, 200, p)
    path.unlink()


def bench_gather_ahead(cfg: ModelConfig, rows: int, tmp: Path) -> None:
    path = tmp / "engram_ahead.safetensors"
    write_sparse_table(path, rows)
    small = cfg.replace(dim=256, engram_num_embeddings=(1, 1))
    module = Engram(small, 0, Numerics.default("reference"))   # wkv kept fp8 + scales
    module.embed = EngramTable.from_safetensors(path, "w", "s")  # the release's row count, mapped
    module.wkv.weight.data.view(torch.uint8).random_(0, 100)
    module.wkv.scale.data.view(torch.uint8).fill_(120)
    gen = torch.Generator().manual_seed(2)
    B, T = 1, 128
    steps = [torch.randint(0, rows, (B, T, 24), generator=gen) for _ in range(6)]
    x = torch.randn(B, T, small.hc_mult, small.dim, generator=gen).to(torch.bfloat16)
    module(x, module.gather(steps[0]))  # warm up the kernels (touching steps[0]'s pages)

    t0 = time.perf_counter()
    for ids in steps[1:3]:
        module(x, module.gather(ids))
    inline = (time.perf_counter() - t0) / 2
    with ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        pending = pool.submit(module.gather, steps[3])
        for ids in steps[4:6]:
            rows_now = pending.result()
            pending = pool.submit(module.gather, ids)  # next step's rows while this layer computes
            module(x, rows_now)
        pending.result()
        ahead = (time.perf_counter() - t0) / 2
    gather = timed(lambda: module.gather(steps[1]), 1)
    print(f"layer (D={small.dim}, T={T}) with first-touch mmap rows: in-layer gather {inline * 1e3:.1f} ms/step, "
          f"gather-ahead {ahead * 1e3:.1f} ms/step (resident gather alone {gather * 1e3:.1f} ms)")
    path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-rows", type=int, default=384006168, help="rows of the sparse table (release: layer 1)")
    parser.add_argument("--tmp", type=Path, default=None, help="directory for the sparse files")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig.from_json(RELEASE.resolve())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_hash(cfg)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        bench_gather(args.table_rows, Path(tmp))
        bench_gather_ahead(cfg, args.table_rows, Path(tmp))


if __name__ == "__main__":
    main()
