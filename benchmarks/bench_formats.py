"""Decoding stored weights on this machine: the table lookup quantised GEMMs use against torch's own casts.

Run from the repository root: python benchmarks/bench_formats.py [--threads N] [--rows N] [--cols N]

For an fp8 (e4m3) and a packed fp4 (e2m1) weight of rows × cols values it prints the best of 5 times
of `formats.decode_bytes` (one lookup of table rows per stored byte) and of the direct route (torch's
fp8 → fp32 cast; unpack the nibbles, then look each code up), in fp32 and in float64 (what invariant
kernels sum fp8 blocks in), with the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from dsv41.model import formats


def best_ms(fn) -> float:
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    fp8 = torch.randint(0, 256, (args.rows, args.cols), dtype=torch.uint8, generator=g)
    fp8[(fp8 & 0x7F) == 0x7F] = 0                                    # no NaN bytes
    fp8 = fp8.view(torch.float8_e4m3fn)
    fp4 = torch.randint(-128, 128, (args.rows, args.cols // 2), dtype=torch.int8, generator=g)
    print(f"{args.rows} × {args.cols} values, {args.threads} thread(s), best of 5")
    print(f"{'weight':<6} {'dtype':<8} {'lookup ms':>10} {'direct ms':>10} {'speed-up':>9}")
    for dtype in (torch.float32, torch.float64):
        cases = (("fp8", lambda: formats.decode_bytes(fp8, "e4m3", dtype), lambda: fp8.to(dtype)),
                 ("fp4", lambda: formats.decode_bytes(fp4, "e2m1x2", dtype),
                  lambda: formats.fp4_decode(formats.unpack_fp4(fp4)).to(dtype)))
        for name, lookup, direct in cases:
            assert torch.equal(lookup(), direct())
            a, b = best_ms(lookup), best_ms(direct)
            print(f"{name:<6} {str(dtype).split('.')[-1]:<8} {a:>10.2f} {b:>10.2f} {b / a:>8.1f}x")


if __name__ == "__main__":
    main()
