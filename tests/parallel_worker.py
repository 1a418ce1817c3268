"""What the parallel tests run on every rank (and once in a single process for the expectation).

`probe` exercises every path that runs a collective — packed prefill of two rows, chunked prefill then
decode, DSpark observe and draft, the engine's greedy generation with and without speculation — and
returns what it saw. `rank_main` joins a gloo world on loopback (the env vars torchrun would set), runs
`probe` for each (tp, ep) layout and numerics, and rank 0 saves the results.
"""

from __future__ import annotations

import functools
import os
import traceback

import torch

PROMPT_LENGTHS = (24, 17)
GENERATED = 10


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 700, (length,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def probe(model) -> dict:
    from dsv41.engine.engine import Engine, EngineConfig
    from dsv41.engine.request import Request
    from dsv41.engine.sampling import SamplingParams

    prompts = [_ids(n, seed=40 + n) for n in PROMPT_LENGTHS]
    out = {}
    cache = model.new_cache(2, 128)
    step = model.step([0, 1], [0, 0], PROMPT_LENGTHS)
    res = model(torch.cat(prompts), step, cache)
    out["prefill"] = model.logits(res.hidden)
    # the same rows chunked: 12 positions, then one at a time (decode)
    cache = model.new_cache(2, 128)
    decode = []
    for start, count in [(0, 12)] + [(12 + i, 1) for i in range(5)]:
        step = model.step([0, 1], [start, start], [count, count])
        res = model(torch.cat([p[start:start + count] for p in prompts]), step, cache)
        decode.append(model.logits(res.hidden))
        model.dspark_observe(res.dspark_hidden, step, cache)
    out["decode"] = torch.cat(decode)
    draft = model.dspark_draft(torch.tensor([int(prompts[0][17]), int(prompts[1][16])]), [16, 16], cache)
    out["draft_ids"], out["draft_logits"] = draft.ids, draft.logits
    for speculative in (False, True):
        engine = Engine(model, None, EngineConfig(n_slots=2, speculative=speculative))
        for p in prompts:
            engine.submit(Request(tuple(p.tolist()), max_new_tokens=GENERATED, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.0)))
        done = sorted((e.completion for e in engine.run() if e.completion is not None), key=lambda c: c.request)
        out[f"greedy_spec{int(speculative)}"] = [c.token_ids for c in done]
    return out


def as_rank(rank: int, world: int, port: int, out_dir: str, work) -> None:
    """Join the loopback world as `rank` (the env vars torchrun would set), run `work()`, record its
    error for the parent, and leave the world once `work`'s frames (which hold the context and the
    model) are gone: a rank whose gloo group outlives the interpreter can be aborted at exit
    ("terminate called without an active exception", docs/PARALLEL.md §3)."""
    import torch.distributed as dist

    from dsv41.parallel import shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        work()
        dist.barrier()
    except Exception as e:
        with open(os.path.join(out_dir, f"error-rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        shutdown()


def runtime(numerics: str):
    """"reference", "fast" (fp32), or "fast-stored": fast fp32 with the fp4 experts kept stored (N30)."""
    from dsv41.config import RuntimeConfig

    stored = numerics == "fast-stored"
    numerics = "fast" if stored else numerics
    return RuntimeConfig(max_seq_len=128, max_batch_size=2, numerics=numerics, stored_experts=stored,
                         dtype="float32" if numerics == "fast" else "bfloat16")


def rank_main(rank: int, world: int, port: int, directory: str, layouts, numerics_modes, out_dir: str) -> None:
    as_rank(rank, world, port, out_dir,
            functools.partial(_probe_layouts, rank, directory, layouts, numerics_modes, out_dir))


def _probe_layouts(rank: int, directory: str, layouts, numerics_modes, out_dir: str) -> None:
    from dsv41.checkpoint.model_io import load_model
    from dsv41.parallel import init_parallel

    for tp, ep in layouts:
        ctx = init_parallel(tp, ep, timeout_s=120)
        for numerics in numerics_modes:
            model = load_model(directory, runtime(numerics), parallel=ctx, check_memory=False)
            result = probe(model)
            result["held"] = {n: t.shape for n, t in model.state_dict().items()}
            if rank == 0:
                torch.save(result, os.path.join(out_dir, f"tp{tp}-ep{ep}-{numerics}.pt"))


def layers_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Each parallel layer at TP = `world` on the same random weights; rank 0 saves inputs and outputs."""
    as_rank(rank, world, port, out_dir, functools.partial(_run_layers, rank, world, out_dir))


def _run_layers(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    from dsv41.model import formats
    from dsv41.model.engram.table import EngramTable
    from dsv41.model.layers import Embedding, Head, RowParallelLinear
    from dsv41.model.numerics import Numerics
    from dsv41.parallel import Shard, init_parallel

    ctx = init_parallel(world, world, timeout_s=60)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    weight, scale = formats.quantize_fp8_weight(torch.randn(64, 128, generator=gen) / 8)
    numerics = Numerics.default("reference")
    cols = Shard(1, world, rank)
    wo_b = RowParallelLinear(128, 64, "fp8", numerics=numerics, shard=cols)
    part = slice(cols.start(128), cols.start(128) + cols.size(128))
    wo_b.weight.data = weight[:, part].clone()
    wo_b.scale.data = scale[:, cols.start(4):cols.start(4) + cols.size(4)].clone()
    vocab = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 15, 7, 8, 3]])
    rows = Shard(0, world, rank)
    embed = Embedding(16, 8, shard=rows)
    embed.weight.data = vocab[rows.start(16):rows.start(16) + rows.size(16)].clone()
    head = Head(16, 8, numerics=numerics, shard=rows)
    head.weight.data = vocab.float()[rows.start(16):rows.start(16) + rows.size(16)].clone()
    table_w, table_s = formats.quantize_fp8_weight(torch.randn(11, 32, generator=gen))
    per_rank = -(-11 // world)
    first, stop = min(rank * per_rank, 11), min((rank + 1) * per_rank, 11)
    table = EngramTable(11, 32, part=(first, stop))
    table.weight.data, table.scale.data = table_w[first:stop].clone(), torch.full((stop - first, 1), 1.0).to(
        torch.float8_e8m0fnu)
    looked = table.lookup(torch.tensor([[0, 10, 5, 6]]))
    dist.all_reduce(looked)
    out = dict(x=x, weight=weight, scale=scale, wo_b=wo_b(x[:, part]), vocab=vocab, ids=ids, embed=embed(ids),
               head=head(embed(ids).float()), table=table_w, engram=looked)
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "layers.pt"))


def golden_main(rank: int, world: int, port: int, goldens, out_dir: str) -> None:
    """dsv41 at TP = EP = world on each recorded config (the weights of `init_random_(model, seed)`,
    written by rank 0 and loaded per rank); rank 0 saves each decode trace."""
    as_rank(rank, world, port, out_dir, functools.partial(_trace_goldens, rank, world, goldens, out_dir))


def _trace_goldens(rank: int, world: int, goldens, out_dir: str) -> None:
    import torch.distributed as dist

    from dsv41.checkpoint.model_io import load_model, save_model
    from dsv41.config import RuntimeConfig
    from dsv41.model import Transformer
    from dsv41.model.init import init_random_
    from dsv41.parallel import init_parallel
    from dsv41.parity import decode_trace
    from test_golden import load_golden

    ctx = init_parallel(world, world, timeout_s=120)
    for i, path in enumerate(goldens):
        cfg, seed, prefill, want = load_golden(path)
        runtime = RuntimeConfig(max_seq_len=2 * want["ids"].shape[1], kernels="blas")
        directory = os.path.join(out_dir, f"ckpt{i}")
        if rank == 0:
            save_model(init_random_(Transformer(cfg, runtime), seed), directory)
        dist.barrier()
        model = load_model(directory, runtime, parallel=ctx, check_memory=False, progress=False)
        trace = decode_trace(model, want["ids"], prefill)
        if rank == 0:
            torch.save({k: torch.cat(v) for k, v in trace.items() if v}, os.path.join(out_dir, f"trace{i}.pt"))
