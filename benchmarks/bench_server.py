"""A bounded load test of `dsv41 serve` on the demo model (random weights: serving cost, not language).

Run from the repository root: python -m benchmarks.bench_server [--clients 64] [--seconds 30]
    [--max-batch 16] [--numerics fast] [--url http://HOST:PORT --model NAME]

Starts a server on loopback (or uses --url), then runs `--clients` concurrent clients for `--seconds`:
each loops over requests, mostly streaming chat completions (thinking on or off, 8-64 new tokens),
some whole ones, some structured (json_schema), and, as real traffic has them, malformed bodies
(--malformed share) and clients that disconnect mid-stream (--disconnect share). Prints requests/s,
tokens/s, TTFT and inter-token latency p50 / p99, outcomes by kind, and the leak checks: the server's
resident memory after warm-up rounds and after the measured one (in-process only), and whether every
cache slot is free again at the end (no request left running or queued).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import random
import statistics
import sys
import time
from collections import Counter

import httpx2

sys.path.insert(0, "tests")


def rss_mib() -> float:
    """Resident memory, after handing freed heap back to the OS (glibc's malloc_trim: allocator caching
    of freed tensors is not a leak, and would read as one)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_local(args):
    import torch

    import dsv41
    from dsv41.config import RuntimeConfig
    from dsv41.demo import ensure_demo_checkpoint
    from dsv41.server.app import ServerConfig
    from dsv41.tokenizer import Tokenizer
    from serving import LiveServer

    torch.set_num_threads(args.threads)
    path = ensure_demo_checkpoint()
    model = dsv41.load(path, RuntimeConfig(max_seq_len=args.max_context, numerics=args.numerics))
    loaded = (model, Tokenizer.from_dir(path))
    config = ServerConfig(model_name="demo", max_batch=args.max_batch, max_context=args.max_context,
                          max_queue=args.clients * 2)
    return LiveServer(lambda: loaded, config).start()


class Tally:
    def __init__(self):
        self.outcomes: Counter = Counter()
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def make_body(rng: random.Random, model: str, args) -> tuple[dict | bytes, str]:
    """One request: (its body, its kind)."""
    roll = rng.random()
    body = {"model": model, "messages": [{"role": "user", "content": f"Question {rng.randrange(10**6)}"}],
            "max_tokens": rng.randint(8, 64), "stream": True, "seed": rng.randrange(2**31)}
    if rng.random() < 0.5:
        body["thinking"] = {"type": "disabled"}
    if roll < args.malformed:
        return rng.choice([b"{not json", json.dumps({"model": model}).encode(),
                           json.dumps({**body, "temperature": 9}).encode()]), "malformed"
    if roll < args.malformed + 0.1:
        body.update(stream=False, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
                    thinking={"type": "disabled"}, max_tokens=80)
        return body, "structured"
    if roll < args.malformed + 0.2:
        body["stream"] = False
        return body, "whole"
    return body, "stream"


async def client_loop(client: httpx2.AsyncClient, url: str, model: str, seed: int, stop_at: float, t: Tally,
                      args):
    rng = random.Random(seed)
    while time.perf_counter() < stop_at:
        body, kind = make_body(rng, model, args)
        start = time.perf_counter()
        try:
            if kind == "malformed":
                r = await client.post(url, content=body, headers={"content-type": "application/json"})
                t.outcomes[f"malformed → {r.status_code}"] += 1
            elif kind in ("whole", "structured"):
                r = await client.post(url, json=body)
                if r.status_code == 200:
                    usage = r.json()["usage"]
                    t.tokens += usage["completion_tokens"]
                    if kind == "structured":
                        json.loads(r.json()["choices"][0]["message"]["content"])
                t.outcomes[f"{kind} → {r.status_code}"] += 1
            else:
                await stream_one(client, url, body, rng.random() < args.disconnect, start, t)
        except (httpx2.HTTPError, ValueError) as e:
            t.outcomes[f"{kind} → {type(e).__name__}"] += 1


async def stream_one(client, url, body, disconnect: bool, start: float, t: Tally) -> None:
    cut_after = random.randint(1, 6) if disconnect else None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            t.outcomes[f"stream → {r.status_code}"] += 1
            return
        last, n = None, 0
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"]
            if not delta or not (delta[0]["delta"].get("content") or delta[0]["delta"].get("reasoning_content")):
                continue
            now = time.perf_counter()
            if last is None:
                t.ttft.append(now - start)
            else:
                t.gaps.append(now - last)
            last, n = now, n + 1
            if cut_after is not None and n >= cut_after:
                t.outcomes["stream → disconnected"] += 1
                t.tokens += n
                return
        t.tokens += n
        t.outcomes["stream → 200"] += 1


def pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{statistics.quantiles(values, n=100)[q - 1] * 1e3:.0f} ms" if len(values) > 1 else \
        f"{values[0] * 1e3:.0f} ms"


async def load(url: str, model: str, tally: Tally, args) -> float:
    limits = httpx2.Limits(max_connections=args.clients * 2)
    async with httpx2.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        stop_at = start + args.seconds
        await asyncio.gather(*[client_loop(client, url + "/v1/chat/completions", model, i, stop_at, tally, args)
                               for i in range(args.clients)])
        return time.perf_counter() - start


def main(args) -> None:
    server = None
    if args.url:
        url, model = args.url, args.model
    else:
        server = start_local(args)
        url, model = server.url, "demo"
    # warm up (first forwards allocate), then measure memory
    httpx2.post(url + "/v1/chat/completions", timeout=120,
                json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    # two short rounds warm every shape and allocator pool; a leak shows as growth over the second
    warm = []
    for _ in range(2):
        asyncio.run(load(url, model, Tally(), argparse.Namespace(**{**vars(args), "seconds": args.seconds / 2})))
        if server:
            server.wait_idle(60)
        warm.append(rss_mib())
    before = warm[-1]
    tally = Tally()
    seconds = asyncio.run(load(url, model, tally, args))
    idle = server.wait_idle(60) if server else None
    after = rss_mib()
    requests = sum(tally.outcomes.values())
    print(f"{args.clients} clients for {seconds:.1f} s (max batch {args.max_batch}, {args.numerics} numerics)")
    print(f"  requests {requests} ({requests / seconds:.1f}/s), generated tokens {tally.tokens} "
          f"({tally.tokens / seconds:.1f} tok/s)")
    print(f"  TTFT p50 {pct(tally.ttft, 50)} p99 {pct(tally.ttft, 99)}; inter-token p50 {pct(tally.gaps, 50)} "
          f"p99 {pct(tally.gaps, 99)}")
    for outcome, n in sorted(tally.outcomes.items()):
        print(f"  {outcome}: {n}")
    if server is not None:
        engine = server.engine
        print(f"  leak checks: slots free at the end {len(engine.free) + len(engine.prefix)}/{engine.config.n_slots} "
              f"(kept for prefix reuse: {len(engine.prefix)}), running {len(engine.running)}, queued "
              f"{engine.queue_depth}, idle: {idle}; RSS after two warm-up rounds {warm[0]:.0f} / {warm[1]:.0f} MiB, "
              f"after the measured round {after:.0f} MiB ({after - before:+.0f})")
        server.stop()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--numerics", choices=("reference", "fast"), default="fast")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--malformed", type=float, default=0.05, help="share of malformed bodies")
    p.add_argument("--disconnect", type=float, default=0.2, help="share of streams cut mid-way")
    p.add_argument("--url", help="a running server instead of one started here")
    p.add_argument("--model", default="dsv41-demo", help="the model name with --url")
    return p.parse_args()


if __name__ == "__main__":
    main(parse_args())
