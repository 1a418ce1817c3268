"""benchmarks/bench_fp4_stream.py builds its C loop against the package's amx.c and prints its figures.

The loop calls `dsv41_amx_tile_fp4` and `dsv41_amx_begin` as the package declares them, so a change of
their signatures that the benchmark did not follow fails to compile here. Where the CPU has AMX tiles,
every part prints a positive time; elsewhere the program says it has nothing to measure.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.model import native

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("stream (prefetches alone)", "stream + tiles, no decoding", "stream + decoding, no tiles", "kernel",
         "kernel, 2 experts a thread")

pytestmark = pytest.mark.skipif(native.c_compiler() is None, reason="no C compiler")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fp4_stream.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_benchmark_compiles_and_times_every_part():
    done = run("--threads", "1", "--experts", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "did not compile" not in done.stdout
    if not native.amx_products():
        assert "nothing to measure" in done.stdout or "not available" in done.stdout
        return
    for part in PARTS:
        line = re.search(rf"^  {re.escape(part)}\s+([0-9.]+) ns a block per thread\s+([0-9.]+) GB/s$", done.stdout,
                         re.MULTILINE)
        assert line is not None, (part, done.stdout)
        assert float(line.group(1)) > 0 and float(line.group(2)) > 0


def test_a_pool_smaller_than_two_experts_a_thread_is_refused():
    done = run("--threads", "2", "--experts", "3")
    assert done.returncode == 2
    assert "--experts at least 2 a thread" in done.stderr
