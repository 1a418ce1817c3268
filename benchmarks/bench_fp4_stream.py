"""What a stored expert's tile loop costs from memory, piece by piece (docs/NUMERICS.md N42).

Run from the repository root: python benchmarks/bench_fp4_stream.py [--threads 2] [--experts 360]

Compiles `benchmarks/fp4_stream.c` with the package's flags beside its `amx.c` (into a temporary
folder) and runs it: a pool of stored dim-1024 experts read in turn as a 16-token decode step's routed
experts read them, timing the loop's prefetch stream alone, then with the tile steps (no decoding),
with the decoding (no tiles), the whole kernel, and the kernel on a pool that stays in the cores' L2.
A plain sum of a 256 MB buffer is timed in the same run. Needs a C compiler and AMX tiles; says so and
stops without them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_reference import bandwidth_gb_s  # noqa: E402
from dsv41.model.native import FLAGS, c_compiler        # noqa: E402

NATIVE = ROOT / "dsv41" / "model" / "native"


def build(folder: Path) -> Path | None:
    """The benchmark compiled into folder, or None (no compiler, or it refused: its message printed)."""
    compiler = c_compiler()
    if compiler is None:
        print("no C compiler (cc or gcc) on PATH")
        return None
    program = folder / "fp4_stream"
    flags = [flag for flag in FLAGS if flag not in ("-shared", "-fPIC")]
    done = subprocess.run([compiler, *flags, f"-I{NATIVE}", str(ROOT / "benchmarks" / "fp4_stream.c"),
                           str(NATIVE / "amx.c"), "-o", str(program)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"the benchmark did not compile:\n{done.stderr}")
        return None
    return program


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=360, help="experts in the pool (0.84 MB each)")
    args = ap.parse_args()
    if args.threads < 1 or args.experts < 2 * args.threads:
        ap.error("--threads must be at least 1 and --experts at least 2 a thread")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        program = build(Path(folder))
        if program is None:
            return
        _, read = bandwidth_gb_s()
        print(f"a plain sum reads {read:.1f} GB/s on {args.threads} thread(s)")
        subprocess.run([str(program), str(args.threads), str(args.experts)], check=True)


if __name__ == "__main__":
    main()
