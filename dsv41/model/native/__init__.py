"""A C kernel for the quantised blockwise GEMM at decode sizes, built on first use (docs/NUMERICS.md N11).

Shapes: P pairs (one weight each; 1 for a plain Linear), M activation rows, K reduction width, N outputs.

`blockgemm.c` computes the reference's blockwise GEMM (§6.3) for a few rows straight from the stored
fp8 / fp4 bytes: each block's 32 products summed exactly (fp8 in double lanes, fp4 in int32), rounded
once to fp32, scaled and accumulated in K order: the bits of `Numerics.block_scaled_matmul`'s invariant
path, without decoding the weight into a tensor first. It also quantises a GEMM's activations in one
pass (`fp8_act_quant`, the bytes and scales of `formats.fp8_act_quant`). The torch path decodes every weight byte by a table lookup into a new
tensor and then multiplies it: at a decode step that is several passes over memory per weight.

The library is compiled with the system's C compiler into a cache folder (`$DSV41_CACHE`, else
`$XDG_CACHE_HOME/dsv41`, else `~/.cache/dsv41`), keyed by the source, the flags and this machine's
CPU, so a copy built with `-march=native` never runs on another CPU. Where no compiler or no writable
folder exists, `available()` is False and the policy keeps the torch path; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import formats

SOURCE = Path(__file__).with_name("blockgemm.c")
# Products (P·M·N·K) below which a call runs on one thread: starting a thread here costs 60–100 µs,
# about what one thread spends on a 256 × 512 weight for one row.
THREAD_FROM = 1 << 20
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-pthread")


def cache_dir() -> Path:
    if os.environ.get("DSV41_CACHE"):
        return Path(os.environ["DSV41_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsv41"


def _cpu_identity() -> str:
    """What `-march=native` depends on: the CPU's model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(keep)


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_identity().encode()).hexdigest()[:16]
    return cache_dir() / f"blockgemm-{key}.so"


def build(target: Path) -> None:
    """Compile `blockgemm.c` into `target` (written under a temporary name, then renamed: two processes
    building at once both end with a whole library). Raises OSError or CalledProcessError."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: Path) -> ctypes.CDLL:
    """The compiled library at `path`, its entry point typed. Raises OSError."""
    lib = ctypes.CDLL(str(path))
    fn = lib.dsv41_block_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 8
    quant = lib.dsv41_fp8_act_quant
    quant.restype = None
    quant.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_float] * 2 + [ctypes.c_void_p] * 2
    return lib


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    # the compiled code, loaded once per process: a read-only resource, not a setting (the policy
    # object decides whether it is used)
    try:
        path = library_path()
        if not path.exists():
            build(path)
        return load(path)
    except (OSError, subprocess.SubprocessError):
        return None


def available() -> bool:
    """Whether the kernel is built (or can be) and loads on this machine."""
    return _library() is not None


@functools.lru_cache(maxsize=None)
def _tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """formats.py's exact byte values as blockgemm.c reads them: e4m3 [256] as floats, 2⁹ · e4m3 as
    int32 (NaN bytes as 0: a NaN activation's block scale is NaN too), 2 · e2m1 [16] as int8."""
    e4m3 = formats.byte_values("e4m3")
    scaled = torch.nan_to_num(e4m3 * 512, nan=0.0)
    e2m1 = formats.E2M1_VALUES * 2
    if not (torch.equal(scaled, scaled.round()) and torch.equal(e2m1, e2m1.round())):
        raise AssertionError("e4m3 values are not multiples of 2^-9 or e2m1 values not of 1/2")
    return e4m3.contiguous(), scaled.to(torch.int32).contiguous(), e2m1.to(torch.int8).contiguous()


def block_gemm(q: torch.Tensor, q_scale: torch.Tensor, stored: torch.Tensor, w_scale: torch.Tensor,
               storage: str) -> torch.Tensor | None:
    """`Numerics.block_scaled_matmul`'s invariant result for CPU tensors: q [P, M, K] e4m3,
    q_scale [P, M, K/32] fp32, stored [P, N, K] e4m3 or [P, N, K/2] packed e2m1 bytes, w_scale
    [P, N, K/32] fp32 → fp32 [P, M, N]; None where the kernel is not available or could not run."""
    lib = _library()
    if lib is None:
        return None
    P, M, K = q.shape
    N = stored.shape[-2]
    q, q_scale = q.contiguous(), q_scale.float().contiguous()
    stored, w_scale = stored.contiguous(), w_scale.float().contiguous()
    e4m3, e4m3_int, e2m1_int = _tables()
    out = torch.empty(P, M, N, dtype=torch.float32)
    threads = torch.get_num_threads() if P * M * N * K >= THREAD_FROM else 1
    status = lib.dsv41_block_gemm(P, M, N, K, int(storage == "fp4"), threads, q.data_ptr(),
                                  q_scale.data_ptr(), stored.data_ptr(), w_scale.data_ptr(), e4m3.data_ptr(),
                                  e4m3_int.data_ptr(), e2m1_int.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def fp8_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`formats.fp8_act_quant(x)` (e4m3 codes [..., K], fp32 scales [..., K/32]) of a CPU tensor, in one
    pass; None where the kernel is not available."""
    lib = _library()
    if lib is None:
        return None
    flat = x.float().reshape(-1, x.shape[-1]).contiguous()
    q = torch.empty(flat.shape, dtype=torch.uint8)
    scale = torch.empty(flat.shape[0], flat.shape[1] // formats.FP8_WEIGHT_BLOCK, dtype=torch.float32)
    lib.dsv41_fp8_act_quant(flat.shape[0], flat.shape[1], flat.data_ptr(), formats.ACT_AMAX_FLOOR,
                            formats.INV_FP8_MAX_F32, q.data_ptr(), scale.data_ptr())
    return q.view(torch.float8_e4m3fn).view(x.shape), scale.view(*x.shape[:-1], -1)
