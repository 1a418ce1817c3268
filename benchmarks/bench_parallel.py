"""Tensor + expert parallelism on CPU: speed at world 1, 2, 4, bytes per collective, memory per rank.

Run from the repository root: python -m benchmarks.bench_parallel [--worlds 1,2,4] [--prefill T] [--decode N]
[--numerics reference|fast] [--skip-speed]

Three parts:

1. Speed. A medium V4.1-shaped config (bench_model's, widened so TP 4 still cuts it: 16 query heads,
   4 output groups, 8 indexer heads, 8 experts, vocabulary 768 = the demo tokenizer's, two Engram layers,
   two DSpark stages) is written once into a temporary directory. For each world size that many processes
   are spawned (gloo on loopback, one intra-op thread each), each loads its slice with TP = EP = world,
   and rank 0 times a T-token prefill from position 0 (best of 3) and N one-token decode steps with their
   logits at batch 1 and at batch 4 (median per step; the batch-4 cache is prefilled untimed). Each world
   also times one all-reduce of fp32 [1, D] (a decode step's wo_b / MoE call), and this process times rank
   0's slice of each world alone with the collectives stubbed out (prefill once, decode at batch 1): the
   compute a rank is left with, apart from waiting for its peers. The machine has few cores: a world larger than os.cpu_count()
   oversubscribes them, and its figures say more about the scheduler than about the collectives. The
   load average is printed with the figures.
2. Communication. In the world > 1 runs, torch.distributed's collectives are wrapped (in the benchmark's
   processes only; the model's code is unchanged) during one more decode step and one DSpark draft, and
   each call's payload is summed by call site (the module whose forward issued it). The payload is the
   bytes of the tensor a rank passes in (an all-gather: its own part); what the wire carries depends on
   the algorithm (a ring all-reduce sends about 2(p-1)/p of it, an all-gather (p-1) parts). The formulas
   `decode_comm_bytes` / `draft_comm_bytes` give the same figures from the config; both are printed with
   their ratio, then the formulas for the released config at TP = EP = 8.
3. Memory. `plan_load` on the meta device for the released config at TP = EP = 1, 2, 4, 8, reference
   numerics, context 4096, batch 1, Engram tables in memory and memory-mapped (`engram_on_disk`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from dsv41.config import RELEASED_CONFIG, ModelConfig, RuntimeConfig

PREFILL_REPEATS = 3
LATENCY_CALLS = 200
BATCHES = (1, 4)
DECODE_SITES = ("embed", "wo_b", "indexer", "moe", "engram", "head")
DRAFT_SITES = ("embed", "wo_b", "moe", "head", "markov embed", "markov head")
# the forward (code qualname) that issues each of the model's collectives
SITES = {"Embedding.forward": "embed", "RowParallelLinear.reduced": "wo_b", "Indexer.scores": "indexer",
         "MoE.routed": "moe", "Engram.forward": "engram", "Head.forward": "head"}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_to_all_single")
RELEASED_CONTEXT = 65536
MEMORY_CONTEXT = 4096
GiB = 2 ** 30

# bench_model's config, with what TP 4 must cut made divisible by 4 (>= 4 query heads per rank) and
# Engram + DSpark added; vocab_size and the Engram token-map size come from the demo's tokenizer
CONFIG = dict(
    dim=256, moe_inter_dim=128, n_layers=8, n_heads=16, n_routed_experts=8, n_shared_experts=1,
    n_activated_experts=2, q_lora_rank=128, head_dim=128, rope_head_dim=32, o_groups=4, o_lora_rank=64,
    window_size=32, compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0), kv_source_layers=(2, 4),
    index_source_layers=(2, 4, 6), index_n_heads=8, index_head_dim=64, index_topk=32, candidate_source_layer=4,
    candidate_topk_blocks=8, candidate_block_size=4, route_scale=1.5, swiglu_limit=10.0, original_seq_len=256,
    rope_factor=4, compress_rope_theta=160000.0,
    engram_layer_ids=(1, 3), engram_vocab_size=2000, engram_max_ngram_size=4, engram_pad_id=2, engram_n_heads=2,
    engram_head_dim=64,
    n_mtp_layers=2, dspark_block_size=5, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=32,
    dspark_n_routed_experts=4, dspark_n_activated_experts=2,
)


# ---------------------------------------------------------------------------------------- the formulas

def decode_comm_bytes(cfg: ModelConfig, tp: int, ep: int, batch: int, context: int, *,
                      itemsize: int = 2) -> dict[str, int]:
    """Bytes one rank passes to the collectives of one decode step, by call site (DECODE_SITES).

    The step feeds `batch` rows one token each, every row ending at `context` positions (a ratio-r
    index source scores context // r compressed positions), and takes every row's logits. itemsize:
    the model's compute dtype (2: bf16, reference numerics; 4: fp32, fast), which the indexer's scores
    are in. Over TP: the embedding's bf16 rows [N, D], every block's wo_b fp32 [N, D], each index
    source's scores [N, C], each Engram layer's bf16 rows [N, columns · head_dim], the head's fp32 part
    [N, V / tp]; over EP: every block's MoE fp32 [N, D]. DSpark drafting is `draft_comm_bytes`.
    """
    N, D = batch, cfg.dim
    out = dict.fromkeys(DECODE_SITES, 0)
    if tp > 1:
        out["embed"] = N * D * 2
        out["wo_b"] = cfg.n_layers * N * D * 4
        out["indexer"] = sum(N * (context // cfg.compress_ratios[layer]) * itemsize
                             for layer in cfg.index_source_layers)
        out["engram"] = len(cfg.engram_layer_ids) * N * cfg.engram_hash_columns * cfg.engram_head_dim * 2
        out["head"] = N * (cfg.vocab_size // tp) * 4
    if ep > 1:
        out["moe"] = cfg.n_layers * N * D * 4
    return out


def draft_comm_bytes(cfg: ModelConfig, tp: int, ep: int, batch: int) -> dict[str, int]:
    """Bytes one rank passes to the collectives of one DSpark draft of `batch` rows (DRAFT_SITES).

    The Bs = dspark_block_size draft rows of each row go through the embedding, every stage's wo_b
    and MoE and the tied head; then, draft row by draft row, the Markov head embeds the previous token
    (bf16 [B, Rm]) and projects it to a vocabulary bias (fp32 [B, V / tp]).
    """
    if not cfg.dspark_enabled:
        return dict.fromkeys(DRAFT_SITES, 0)
    R, D, Bs, V = batch * cfg.dspark_block_size, cfg.dim, cfg.dspark_block_size, cfg.vocab_size
    out = dict.fromkeys(DRAFT_SITES, 0)
    if tp > 1:
        out["embed"] = R * D * 2
        out["wo_b"] = cfg.n_mtp_layers * R * D * 4
        out["head"] = R * (V // tp) * 4
        out["markov embed"] = Bs * batch * cfg.dspark_markov_rank * 2
        out["markov head"] = Bs * batch * (V // tp) * 4
    if ep > 1:
        out["moe"] = cfg.n_mtp_layers * R * D * 4
    return out


# ---------------------------------------------------------------------------------------- counting

def _qualname(frame) -> str:
    code = frame.f_code
    if hasattr(code, "co_qualname"):                                  # Python 3.11+
        return code.co_qualname
    owner = frame.f_locals.get("self")
    return code.co_name if owner is None else f"{type(owner).__name__}.{code.co_name}"


def _site(frame) -> str:
    """The call site of a collective: the forward that called it (a Markov head's own parts apart)."""
    label = SITES.get(_qualname(frame), _qualname(frame))
    outer = frame.f_back
    while outer is not None and os.sep + "torch" + os.sep in outer.f_code.co_filename:     # nn.Module's call
        outer = outer.f_back
    if outer is not None and _qualname(outer) == "MarkovHead.forward":
        label = "markov " + label
    return label


def _payload(name: str, args, kwargs) -> torch.Tensor:
    if name == "all_gather":
        return args[1] if len(args) > 1 else kwargs["tensor"]
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return args[1] if len(args) > 1 else kwargs["input" if name == "all_to_all_single" else "input_tensor"]
    return args[0] if args else kwargs["tensor"]


@contextmanager
def counting():
    """Wrap torch.distributed's collectives; yields {site: [calls, bytes, {(dtype, shape)}]}."""
    import torch.distributed as dist

    seen: dict[str, list] = {}
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            tensor = _payload(name, args, kwargs)
            entry = seen.setdefault(_site(sys._getframe(1)), [0, 0, set()])
            entry[0] += 1
            entry[1] += tensor.numel() * tensor.element_size()
            entry[2].add((str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
            return fn(*args, **kwargs)
        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextmanager
def no_collectives():
    """Collectives that move nothing, for one process standing in for a rank of a larger world: an
    all-reduce leaves the rank's own part, an all-gather repeats it (the shapes are right, the values
    are not)."""
    import torch.distributed as dist

    def gather(parts, tensor, *args, **kwargs):
        for part in parts:
            part.copy_(tensor)

    saved = dist.all_reduce, dist.all_gather
    dist.all_reduce, dist.all_gather = (lambda tensor, *args, **kwargs: None), gather
    try:
        yield
    finally:
        dist.all_reduce, dist.all_gather = saved


# ---------------------------------------------------------------------------------------- one rank

def runtime(numerics: str, max_len: int) -> RuntimeConfig:
    return RuntimeConfig(max_seq_len=max_len, max_batch_size=max(BATCHES), numerics=numerics,
                         dtype="float32" if numerics == "fast" else "bfloat16")


@torch.no_grad()
def latency_us(model) -> float:
    """Median µs of one all-reduce of a decode step's fp32 [1, D] over the world (the cost of a call)."""
    import torch.distributed as dist

    x, times = torch.zeros(1, model.cfg.dim), []
    dist.barrier()
    for _ in range(LATENCY_CALLS):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


@torch.no_grad()
def measure(model, sync, prefill: int, decode: int, counted: bool, repeats: int = PREFILL_REPEATS,
            batches: tuple[int, ...] = BATCHES) -> dict:
    """Rank-local timings (and, when `counted`, the bytes of one decode step and one draft per batch)."""
    max_len = prefill + decode + 1
    V = model.cfg.vocab_size
    ids = torch.randint(3, V, (max(batches), max_len), generator=torch.Generator().manual_seed(1))  # same on every rank
    model(ids[:1, :8], 0, model.new_cache(1, max_len))                        # warm-up
    out = {"comm": {}, "draft": {}}
    prefill_s = float("inf")
    for _ in range(repeats):                                                   # best of: the machine is shared
        cache = model.new_cache(1, max_len)
        sync()
        t0 = time.perf_counter()
        res = model(ids[:1, :prefill], 0, cache)
        prefill_s = min(prefill_s, time.perf_counter() - t0)
    out["prefill_tps"] = prefill / prefill_s
    for batch in batches:
        if batch != 1:
            cache = model.new_cache(batch, max_len)
            res = model(ids[:batch, :prefill], 0, cache)
        if counted and model.cfg.dspark_enabled:
            # the rings hold positions 0 … prefill − 1; the draft reads them and writes nothing
            model.dspark_observe(res.dspark_hidden, 0, cache)
            with counting() as seen:
                model.dspark_draft(ids[:batch, prefill], prefill - 1, cache)
            out["draft"][batch] = seen
        steps = []
        sync()
        for p in range(prefill, prefill + decode):
            t0 = time.perf_counter()
            res = model(ids[:batch, p:p + 1], p, cache)
            model.logits(res.hidden[:, -1])
            steps.append(time.perf_counter() - t0)
        out[f"decode_ms_{batch}"] = statistics.median(steps) * 1e3
        if counted:
            p = prefill + decode
            with counting() as seen:
                res = model(ids[:batch, p:p + 1], p, cache)
                model.logits(res.hidden[:, -1])
            out["comm"][batch] = (p + 1, seen)                                # (context after the step, bytes)
    return out


def rank_main(rank: int, world: int, port: int, directory: str, numerics: str, prefill: int, decode: int,
              out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from dsv41.parallel import shutdown

    try:
        measure_rank(rank, world, directory, numerics, prefill, decode, out_dir)
    except Exception as e:
        with open(os.path.join(out_dir, f"error-world{world}-rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        shutdown()          # after measure_rank's frame (the context, the model) is gone: docs/PARALLEL.md §3


def measure_rank(rank: int, world: int, directory: str, numerics: str, prefill: int, decode: int,
                 out_dir: str) -> None:
    import torch.distributed as dist

    from dsv41.checkpoint.model_io import load_model
    from dsv41.parallel import init_parallel

    ctx = init_parallel(world, world, timeout_s=300)
    t0 = time.perf_counter()
    model = load_model(directory, runtime(numerics, prefill + decode + 1), parallel=ctx, check_memory=False)
    load_s = time.perf_counter() - t0
    sync = (lambda: dist.barrier()) if ctx.distributed else (lambda: None)
    result = measure(model, sync, prefill, decode, counted=ctx.distributed)
    result["load_s"] = load_s
    result["latency_us"] = latency_us(model) if ctx.distributed else None
    if rank == 0:
        torch.save(result, os.path.join(out_dir, f"world{world}.pt"))


# ---------------------------------------------------------------------------------------- the parent

def solo_rank(world: int, directory: str, args) -> dict:
    """Rank 0's slice of a `world` run timed alone in this process (collectives stubbed out): the
    compute a rank is left with, without waiting for its peers."""
    from dsv41.checkpoint.model_io import load_model
    from dsv41.parallel import ParallelContext

    # a group object, so every module that reduces when it has one calls the stubs (which ignore it)
    ctx = ParallelContext(rank=0, world_size=world, tp_size=world, ep_size=world, tp_group="stub", ep_group="stub")
    model = load_model(directory, runtime(args.numerics, args.prefill + args.decode + 1), parallel=ctx,
                       check_memory=False)
    with no_collectives():
        return measure(model, lambda: None, args.prefill, args.decode, counted=False, repeats=1, batches=(1,))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def medium_config() -> tuple[ModelConfig, Path]:
    """The medium config and the demo directory whose tokenizer.json it shares (for Engram's hash)."""
    from dsv41.demo import ensure_demo_checkpoint
    from dsv41.model.engram.hashing import table_rows

    demo = ensure_demo_checkpoint()
    shipped = json.loads((demo / "config.json").read_text())
    base = ModelConfig.from_json(RELEASED_CONFIG).to_dict()
    base.update(CONFIG, vocab_size=shipped["vocab_size"], dspark_noise_token_id=shipped["dspark_noise_token_id"],
                engram_compressed_vocab_size=shipped["engram_compressed_vocab_size"], vision_n_layers=0)
    base["engram_num_embeddings"] = list(table_rows(len(base["engram_layer_ids"]), base["engram_max_ngram_size"],
                                                    base["engram_n_heads"], base["engram_vocab_size"]))
    return ModelConfig.from_dict(base), demo


def write_checkpoint(cfg: ModelConfig, demo: Path, directory: str) -> None:
    from dsv41.checkpoint.model_io import save_model
    from dsv41.model import Transformer
    from dsv41.model.engram import load_or_build_token_map
    from dsv41.model.init import init_random_

    with torch.no_grad():
        model = init_random_(Transformer(cfg, RuntimeConfig(max_seq_len=256)), 0)
    save_model(model, directory, tokenizer=demo / "tokenizer.json", max_shard_bytes=64 << 20)
    load_or_build_token_map(Path(directory) / "tokenizer.json", cfg.engram_compressed_vocab_size)  # cached once


def run_world(world: int, directory: str, args, out_dir: Path) -> dict | None:
    import torch.multiprocessing as mp

    try:
        mp.start_processes(rank_main, nprocs=world, start_method="spawn", join=True,
                           args=(world, _free_port(), directory, args.numerics, args.prefill, args.decode,
                                 str(out_dir)))
    except Exception as e:
        errors = sorted(out_dir.glob(f"error-world{world}-rank*.txt"))
        print(f"world {world} failed: " + ("\n".join(p.read_text() for p in errors) or str(e)))
        return None
    return torch.load(out_dir / f"world{world}.pt")


def _fmt(n: float) -> str:
    if n >= 2 ** 20:
        return f"{n / 2 ** 20:.2f} MiB"
    if n >= 2 ** 10:
        return f"{n / 2 ** 10:.1f} KiB"
    return f"{n:.0f} B"


def _shapes(entry) -> str:
    kinds = sorted(entry[2])
    return ", ".join(f"{d}{list(s)}" for d, s in kinds[:2]) + (f" (+{len(kinds) - 2} shapes)" if len(kinds) > 2 else "")


def print_comparison(title: str, sites, seen: dict, formula: dict[str, int]) -> None:
    print(f"  {title}")
    print(f"    {'site':<13} {'calls':>5} {'measured':>11} {'formula':>11} {'ratio':>6}   tensors passed")
    for site in list(sites) + sorted(set(seen) - set(sites)):
        calls, measured = (seen[site][0], seen[site][1]) if site in seen else (0, 0)
        want = formula.get(site, 0)
        ratio = f"{measured / want:6.3f}" if want else ("     -" if not measured else "   inf")
        shapes = _shapes(seen[site]) if site in seen else ""
        print(f"    {site:<13} {calls:>5} {_fmt(measured):>11} {_fmt(want):>11} {ratio}   {shapes}")
    total, want = sum(e[1] for e in seen.values()), sum(formula.values())
    print(f"    {'total':<13} {'':>5} {_fmt(total):>11} {_fmt(want):>11} "
          f"{(total / want if want else float('nan')):6.3f}")


def speed(args) -> None:
    cfg, demo = medium_config()
    from dsv41.checkpoint.sharding import allowed_world_sizes

    worlds = [w for w in args.worlds if w in allowed_world_sizes(cfg, args.worlds)]
    for w in sorted(set(args.worlds) - set(worlds)):
        print(f"world {w}: the medium config does not cut into {w} parts; skipped")
    itemsize = 4 if args.numerics == "fast" else 2
    cores = os.cpu_count()
    print(f"== 1. speed: dim {cfg.dim}, {cfg.n_layers} layers (+{cfg.n_mtp_layers} DSpark), {cfg.n_heads} query "
          f"heads, {cfg.index_n_heads} indexer heads, top-{cfg.n_activated_experts} of {cfg.n_routed_experts} "
          f"experts, vocab {cfg.vocab_size}, Engram layers {list(cfg.engram_layer_ids)}; {args.numerics} numerics; "
          f"TP = EP = world, 1 thread per rank, gloo on loopback")
    print(f"   this machine has {cores} cores: worlds above {cores} oversubscribe them (ranks wait for a core, "
          f"not only for each other)")
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        t = time.perf_counter()
        write_checkpoint(cfg, demo, directory)
        print(f"   wrote the checkpoint in {time.perf_counter() - t:.1f} s; prefill {args.prefill} tokens (best of "
              f"{PREFILL_REPEATS}), decode {args.decode} steps with logits (median per step)")
        out_dir = Path(directory) / "results"
        out_dir.mkdir()
        for world in worlds:
            t = time.perf_counter()
            results[world] = run_world(world, directory, args, out_dir)
            load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
            print(f"   world {world}: {time.perf_counter() - t:.1f} s in all, load average {load}")
        t = time.perf_counter()
        solo = {w: solo_rank(w, directory, args) for w in worlds} if len(worlds) > 1 else {}
        if solo:
            load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
            print(f"   rank 0's slices alone: {time.perf_counter() - t:.1f} s in all, load average {load}")
    done = {w: r for w, r in results.items() if r is not None}
    if not done:
        return
    base = done.get(1) or done[min(done)]
    print(f"{'world':>5} {'load s':>7} {'prefill tok/s':>14} {'decode ms/tok b1':>17} {'decode ms/step b4':>18} "
          f"{'b4 tok/s':>9}   vs world {1 if 1 in done else min(done)}: prefill, decode b1, decode b4")
    for world, r in done.items():
        ms1, ms4 = r["decode_ms_1"], r["decode_ms_4"]
        print(f"{world:>5} {r['load_s']:>7.2f} {r['prefill_tps']:>14.1f} {ms1:>17.2f} {ms4:>18.2f} "
              f"{4e3 / ms4:>9.1f}   {r['prefill_tps'] / base['prefill_tps']:5.2f}x, "
              f"{base['decode_ms_1'] / ms1:5.2f}x, {base['decode_ms_4'] / ms4:5.2f}x"
              + ("   (oversubscribed)" if world > cores else ""))
    for world, r in done.items():
        if r["latency_us"] is None:
            continue
        calls = {b: sum(e[0] for e in seen.values()) for b, (_, seen) in r["comm"].items()}
        share = ", ".join(f"batch {b}: {n} calls ≈ {n * r['latency_us'] / 1e3:.1f} ms = "
                          f"{n * r['latency_us'] / 10 / r[f'decode_ms_{b}']:.0f}% of the step"
                          for b, n in calls.items())
        print(f"  world {world}: one all-reduce of fp32 [1, {cfg.dim}] takes {r['latency_us']:.0f} µs (median of "
              f"{LATENCY_CALLS}); a decode step's collectives at that latency: {share}")
    if solo:
        first = solo[min(solo)]
        print(f"  rank 0's slice alone (one process, collectives stubbed out: a rank's compute without its peers; "
              f"prefill once, batch 1 only), vs world {min(solo)} alone")
        for world, r in solo.items():
            print(f"{world:>5} {'':>7} {r['prefill_tps']:>14.1f} {r['decode_ms_1']:>17.2f} {'-':>18} {'-':>9}   "
                  f"{r['prefill_tps'] / first['prefill_tps']:5.2f}x, {first['decode_ms_1'] / r['decode_ms_1']:5.2f}x")
    print()
    print("== 2a. bytes per rank passed to the collectives, medium config, measured (rank 0) vs the formula")
    for world, r in done.items():
        for batch, (context, seen) in r["comm"].items():
            print_comparison(f"world {world}, decode step at batch {batch}, context {context}", DECODE_SITES, seen,
                             decode_comm_bytes(cfg, world, world, batch, context, itemsize=itemsize))
        for batch, seen in r["draft"].items():
            print_comparison(f"world {world}, DSpark draft at batch {batch} ({cfg.dspark_block_size} rows each)",
                             DRAFT_SITES, seen, draft_comm_bytes(cfg, world, world, batch))
    print()


def released_comm() -> None:
    cfg = ModelConfig.from_json(RELEASED_CONFIG)
    tp = ep = 8
    print(f"== 2b. the released config, formula: bytes per rank per step at TP = EP = {tp}, batch 1 "
          f"(reference numerics: bf16 indexer scores)")
    contexts = (4096, RELEASED_CONTEXT, 1 << 20)
    rows = {c: decode_comm_bytes(cfg, tp, ep, 1, c) for c in contexts}
    print(f"  {'decode site':<13} " + " ".join(f"{f'context {c:,}':>17}" for c in contexts))
    for site in DECODE_SITES:
        print(f"  {site:<13} " + " ".join(f"{_fmt(rows[c][site]):>17}" for c in contexts))
    print(f"  {'total':<13} " + " ".join(f"{_fmt(sum(rows[c].values())):>17}" for c in contexts))
    calls = 1 + 2 * cfg.n_layers + len(cfg.index_source_layers) + len(cfg.engram_layer_ids) + 1
    print(f"  ({calls} collectives per decode step at least (the indexer's scores go in column tiles when long); "
          f"the indexer term grows with the context: index sources {list(cfg.index_source_layers)} at ratios "
          f"{[cfg.compress_ratios[l] for l in cfg.index_source_layers]})")
    draft = draft_comm_bytes(cfg, tp, ep, 1)
    print(f"  DSpark draft of {cfg.dspark_block_size} rows, batch 1 (separate from the step): "
          + ", ".join(f"{k} {_fmt(v)}" for k, v in draft.items()) + f"; total {_fmt(sum(draft.values()))}")
    print()


def memory() -> None:
    from dsv41.checkpoint.plan import meta_model, plan_load

    cfg = ModelConfig.from_json(RELEASED_CONFIG)
    rt = RuntimeConfig(max_seq_len=MEMORY_CONTEXT, numerics="reference")
    model = meta_model(cfg, rt)
    print(f"== 3. per-rank memory of the released config (plan_load, meta device): reference numerics, context "
          f"{MEMORY_CONTEXT:,}, batch 1, TP = EP")
    print(f"  {'TP=EP':>5} {'Engram':<10} {'weights held':>13} {'routed experts':>15} {'Engram tables':>14} "
          f"{'caches':>10} {'needed at peak':>15}")
    for tp in (1, 2, 4, 8):
        for on_disk in (False, True):
            plan = plan_load(cfg, rt, world_size=tp, ep_size=tp, engram_on_disk=on_disk, model=model)
            engram = f"{plan.engram / GiB:.2f} GiB" + ("*" if on_disk else " ")
            print(f"  {tp:>5} {'on disk' if on_disk else 'in memory':<10} {plan.weight_bytes / GiB:>9.2f} GiB "
                  f"{plan.weights.get('routed experts', 0) / GiB:>11.2f} GiB {engram:>14} "
                  f"{plan.cache / 2 ** 20:>6.1f} MiB {plan.on_device / GiB:>11.2f} GiB")
    print("  * memory-mapped from disk, not held (page cache); routed experts: the backbone's (DSpark stages' "
          "experts count in weights)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes (TP = EP = world)")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--numerics", choices=("reference", "fast"), default="reference")
    ap.add_argument("--skip-speed", action="store_true", help="only the formula and the memory table")
    args = ap.parse_args()
    args.worlds = [int(w) for w in args.worlds.split(",") if w]
    torch.set_num_threads(1)
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {load}")
    if not args.skip_speed:
        speed(args)
    released_comm()
    memory()


if __name__ == "__main__":
    main()
