"""C kernels for the CPU's decode steps and reference prefills, built on first use (docs/NUMERICS.md
N11–N18).

Shapes: P pairs (one weight each; 1 for a plain Linear), M activation rows, K reduction width, N outputs.

`blockgemm.c` computes the reference's blockwise GEMM (§6.3) straight from the stored fp8 / fp4 bytes,
a decode step's rows one by one and a prefill's in register tiles: each block's 32 products summed
exactly (in double lanes; fp4 in int32 on CPUs without AVX-512), rounded once to fp32, scaled and
accumulated in K order: the bits of `Numerics.block_scaled_matmul`'s invariant path, without decoding
the weight into a tensor first. It also quantises a GEMM's activations in one
pass and the whole quantised linear in one call (`quantized_linear`). The torch path decodes every
weight byte by a table lookup into a new tensor and then multiplies it: at a decode step that is
several passes over memory per weight. `quantize.c` holds the QDQ points: the activation quantisation
(`fp8_act_quant`, the bytes and scales of `formats.fp8_act_quant`), the window KV's `fp8_qdq` and the
indexer's `fp4_qdq_e8m0`, each with formats.py's values.

`gemv.c` multiplies a few rows by a bf16 or fp32 weight in one pass over it (`gemv`): fast numerics'
fp32 sums in its own order, where torch's bf16 GEMM (oneDNN) costs ~20–40 µs per call beyond reading
the weight, or (`exact`) the invariant kernels' float64 product without a float64 copy of the weight.
It also runs fast numerics' routed experts of a few tokens in one call (`routed_experts`). Where the CPU
has AMX tiles, both multiply bf16 of more than a few rows on them (`amx.c`: the weight read in place as
the tiles' A operand, the activations packed once per call; N37).
`mixes.c` computes the hyper-connection mixes with Sinkhorn (`split_mixes`) with the bits of the
reference-order torch path, in one call instead of ~90 torch operations. `topk.c` takes topk.py's
top-k (ties to the lower index) in one call instead of its keys' ~10 operations, and fast numerics'
router after the gate's logits (`route`: √softplus, the biased top-k, the normalised weights);
`attention.c` a fast decode step's sparse attention (one softmax with the sink) instead of ~20,
`norm.c` its RMSNorms, `indexer.c` its index scores (a ReLU-weighted head sum per key) instead of ~10
per batch row. `sublayers.c` strings those kernels together for a decode step's attention projections
(in and out) and its whole MoE, three calls a layer where there were fourteen, with the same bits (N33),
and for a block's way into its attention and its feed-forward half (N35);
`compressed.c` for its compressed branch: a kv source's new cache rows and an index source's choice of
positions, two calls where there were a dozen (N34).

Threads come from OpenMP, which loads as torch's own copy of the runtime (the same soname), so a call
joins torch's warm pool (~1 µs) instead of starting threads.

The library is compiled with the system's C compiler into a cache folder (`$DSV41_CACHE`, else
`$XDG_CACHE_HOME/dsv41`, else `~/.cache/dsv41`), keyed by the source, the flags and this machine's
CPU, so a copy built with `-march=native` never runs on another CPU. Where no compiler or no writable
folder exists, `available()` is False and the policy keeps the torch path; nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import formats

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("blockgemm.c", "quantize.c", "gemv.c", "amx.c", "mixes.c", "rope.c", "topk.c", "attention.c",
                             "norm.c", "indexer.c", "engram.c", "sublayers.c", "compressed.c"))
# Included by the sources (bf16 ⇄ fp32, a thread's share of a loop, the kernels one source calls from
# another): part of the library's key, found in
# this folder (-I).
HEADERS = tuple(Path(__file__).with_name(name) for name in ("bf16.h", "span.h", "kernels.h", "fp4.h", "exp.h"))
# Products (P·M·N·K) below which a block GEMM runs on one thread (OpenMP's warm pool costs ~1 µs to
# join; one thread sums ~2¹⁵ products in ~30 µs).
THREAD_FROM = 1 << 15
# Weight values (P·N·K) below which `gemv` runs on one thread: joining OpenMP's warm pool costs ~1 µs,
# what one thread spends on ~16K bf16 weights.
GEMV_THREAD_FROM = 1 << 15
# Engram row values (rows · De) below which a lookup runs on one thread: a decode step's 24 rows of 256
# are ~6K values, a 512-token prefill's ~3M.
ENGRAM_THREAD_FROM = 1 << 16
# Scores (rows · n) below which a top-k runs on one thread.
TOPK_THREAD_FROM = 1 << 16
# -ffp-contract=off keeps blockgemm.c's fp32 steps unfused (its bits); gemv.c fuses by intrinsics.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-fopenmp")


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
    code = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(code + " ".join(FLAGS).encode() + _cpu_identity().encode()).hexdigest()[:16]
    return cache_dir() / f"dsv41-native-{key}.so"


def c_compiler() -> str | None:
    """The C compiler the library is built with: $CC, else cc or gcc on PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(target: Path) -> None:
    """Compile the sources into `target` (written under a temporary name, then renamed: two processes
    building at once both end with a whole library). Raises OSError or CalledProcessError."""
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        include = f"-I{Path(__file__).parent}"
        subprocess.run([compiler, *FLAGS, include, *map(str, SOURCES), "-o", tmp], check=True, capture_output=True,
                       timeout=120)
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
    whole = lib.dsv41_quantized_linear
    whole.restype = ctypes.c_int
    whole.argtypes = ([ctypes.c_int64] * 4 + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_float] * 2
                      + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4)
    lib.dsv41_fp8_qdq.restype = ctypes.c_int
    lib.dsv41_fp8_qdq.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_float] * 2 + [ctypes.c_void_p] * 2
    lib.dsv41_fp4_qdq_e8m0.restype = None
    lib.dsv41_fp4_qdq_e8m0.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_float] * 2 + [ctypes.c_void_p]
    quant = lib.dsv41_fp8_act_quant
    quant.restype = None
    quant.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_float] * 2 + [ctypes.c_void_p] * 2
    gemv = lib.dsv41_gemv
    gemv.restype = ctypes.c_int
    gemv.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 3
    mixes = lib.dsv41_split_mixes
    mixes.restype = ctypes.c_int
    mixes.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 3
    lib.dsv41_hc_mixes.restype = ctypes.c_int
    lib.dsv41_hc_mixes.argtypes = ([ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64]
                                   + [ctypes.c_float] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 3)
    lib.dsv41_engram_rows.restype = None
    lib.dsv41_engram_rows.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p]
    lib.dsv41_hc_collapse.restype = None
    lib.dsv41_hc_collapse.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3
    lib.dsv41_hc_expand.restype = None
    lib.dsv41_hc_expand.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 5
    lib.dsv41_hc_enter.restype = ctypes.c_int
    lib.dsv41_hc_enter.argtypes = ([ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 8 + [ctypes.c_int64]
                                   + [ctypes.c_float] * 2 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                             ctypes.c_float] + [ctypes.c_void_p] * 4)
    lib.dsv41_rope.restype = None
    lib.dsv41_rope.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3
    lib.dsv41_gemv_exact_kn.restype = ctypes.c_int
    lib.dsv41_gemv_exact_kn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 3
    lib.dsv41_sparse_attention.restype = ctypes.c_int
    lib.dsv41_sparse_attention.argtypes = ([ctypes.c_int64] * 6 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
                                           + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2
                                           + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_float] * 2
                                           + [ctypes.c_void_p, ctypes.c_int])
    lib.dsv41_gather_compressed.restype = ctypes.c_int
    lib.dsv41_gather_compressed.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4
    lib.dsv41_rms_norm.restype = None
    lib.dsv41_rms_norm.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_void_p, ctypes.c_int] * 2 + [ctypes.c_void_p]
    lib.dsv41_topk.restype = None
    lib.dsv41_topk.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3
    lib.dsv41_route.restype = ctypes.c_int
    lib.dsv41_route.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_float] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 6
    lib.dsv41_vector_blocks.restype = ctypes.c_int
    lib.dsv41_vector_blocks.argtypes = []
    lib.dsv41_gemv_wide.restype = ctypes.c_int
    lib.dsv41_gemv_wide.argtypes = [ctypes.c_int]
    lib.dsv41_amx_ready.restype = ctypes.c_int
    lib.dsv41_amx_ready.argtypes = []
    lib.dsv41_index_scores.restype = ctypes.c_int
    lib.dsv41_index_scores.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
    experts = lib.dsv41_routed_experts
    experts.restype = ctypes.c_int
    experts.argtypes = ([ctypes.c_int64] * 5 + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 12
                        + [ctypes.c_int, ctypes.c_void_p])
    lib.dsv41_attention_in.restype = ctypes.c_int
    lib.dsv41_attention_in.argtypes = ([ctypes.c_int64] * 6 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_float]
                                       + [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_float] + [ctypes.c_void_p] * 4)
    lib.dsv41_attention_out.restype = ctypes.c_int
    lib.dsv41_attention_out.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_int] + [ctypes.c_void_p] * 5
    lib.dsv41_moe.restype = ctypes.c_int
    lib.dsv41_moe.argtypes = ([ctypes.c_int64] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_float] * 3
                              + [ctypes.c_void_p] * 12)
    lib.dsv41_attention_entry.restype = ctypes.c_int
    lib.dsv41_attention_entry.argtypes = ([ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_float] * 2
                                          + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_float]
                                          + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
                                          + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_float] + [ctypes.c_void_p] * 3
                                          + [ctypes.c_int, ctypes.c_float] + [ctypes.c_void_p] * 4)
    lib.dsv41_ffn_half.restype = ctypes.c_int
    lib.dsv41_ffn_half.argtypes = ([ctypes.c_int64] * 3 + [ctypes.c_void_p] * 7 + [ctypes.c_int64] + [ctypes.c_float] * 2
                                   + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_float]
                                   + [ctypes.c_int64] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_float] * 3
                                   + [ctypes.c_void_p] * 13)
    lib.dsv41_publish.restype = ctypes.c_int
    lib.dsv41_publish.argtypes = ([ctypes.c_int64] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_float]
                                  + [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_float] + [ctypes.c_void_p] * 3)
    lib.dsv41_index_select.restype = ctypes.c_int
    lib.dsv41_index_select.argtypes = ([ctypes.c_int64] * 10 + [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_float]
                                       + [ctypes.c_void_p] * 6)
    lib.dsv41_fp4_rows.restype = None
    lib.dsv41_fp4_rows.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3
    return lib


def _library() -> ctypes.CDLL | None:
    # a compiler tracing the model holds fake tensors with no data: a C kernel handed their pointers
    # writes through garbage, so while tracing every wrapper declines and the torch path is traced
    if torch.compiler.is_compiling():
        return None
    return _loaded()


@functools.lru_cache(maxsize=None)
def _loaded() -> ctypes.CDLL | None:
    # the compiled code, loaded once per process: a read-only resource, not a setting (the policy
    # object decides whether it is used)
    try:
        path = library_path()
        if not path.exists():
            build(path)
        return load(path)
    except (OSError, subprocess.SubprocessError):
        return None


def wide_products(bf16: bool) -> bool:
    """Whether `gemv` outruns torch's GEMM up to `numerics.NATIVE_WIDE_ROWS` rows in fast mode: for bf16
    operands where this build has AVX512-BF16 dot products, for fp32 ones where it has AVX-512 tiles
    (else only up to `NATIVE_GEMV_ROWS`). False while tracing, like every wrapper."""
    return _library() is not None and _wide(bf16)


@functools.lru_cache(maxsize=None)
def _wide(bf16: bool) -> bool:
    return bool(_loaded().dsv41_gemv_wide(bf16))


def amx_products() -> bool:
    """Whether `gemv`'s bf16 products of more than a few rows, and routed experts' groups of more than a
    few rows, multiply on AMX tiles (amx.c, docs/NUMERICS.md N37): this build targets a CPU with AMX-BF16
    and the process may use its tiles. False while tracing, like every wrapper."""
    return _library() is not None and _amx()


@functools.lru_cache(maxsize=None)
def _amx() -> bool:
    return bool(_loaded().dsv41_amx_ready())


def available() -> bool:
    """Whether the kernel is built (or can be) and loads on this machine."""
    return _loaded() is not None


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


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str,
                     pairs: bool) -> torch.Tensor | None:
    """layers.py `quantized_linear` (x [..., K] through weight [N, K] or [N, K/2] with its stored ue8m0
    scales) or, with `pairs`, `quantized_pairs` (x [P, K], row p through weight[p]) in one call: bf16
    [..., N] with the torch path's bits; None where the kernel is not available."""
    lib = _library()
    if lib is None or x.dtype not in _GEMV_DTYPES:
        return None
    x, weight, scale = x.contiguous(), weight.contiguous(), scale.contiguous()
    K = x.shape[-1]
    P, M = (x.shape[0], 1) if pairs else (1, x.numel() // K)
    N = weight.shape[-2]
    out = torch.empty(*x.shape[:-1], N, dtype=torch.bfloat16)
    fp4 = storage == "fp4"
    e4m3, e4m3_int, e2m1_int = _tables()
    threads = torch.get_num_threads() if P * M * N * K >= THREAD_FROM else 1
    status = lib.dsv41_quantized_linear(P, M, N, K, fp4, threads, x.data_ptr(), x.dtype == torch.bfloat16,
                                        formats.ACT_AMAX_FLOOR, formats.INV_FP8_MAX_F32, weight.data_ptr(),
                                        scale.data_ptr(), 1 if fp4 else formats.FP8_WEIGHT_BLOCK, formats.FP8_WEIGHT_BLOCK,
                                        e4m3.data_ptr(), e4m3_int.data_ptr(), e2m1_int.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def fp8_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`formats.fp8_act_quant(x)` (e4m3 codes [..., K], fp32 scales [..., K/32]) of a CPU tensor, in one
    pass; None where the kernel is not available."""
    lib = _library()
    if lib is None:
        return None
    flat = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    K = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(*x.shape[:-1], K // formats.FP8_WEIGHT_BLOCK, dtype=torch.float32)
    lib.dsv41_fp8_act_quant(flat.numel() // K, K, flat.data_ptr(), formats.ACT_AMAX_FLOOR,
                            formats.INV_FP8_MAX_F32, q.data_ptr(), scale.data_ptr())
    return q, scale


def topk(scores: torch.Tensor, k: int, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
    """topk.py's `topk(scores, k, sorted=sorted)` of fp32 or bf16 CPU scores [..., n] (ties to the lower
    index; with `sorted` in descending order, else in none): (values in the scores' dtype, indices
    int64), or None where the kernel is not available or does not take it."""
    lib = _library()
    n = scores.shape[-1]
    if lib is None or scores.dtype not in _GEMV_DTYPES or not 0 < k <= n or n >= 1 << 32 or scores.numel() == 0:
        return None
    flat = scores.contiguous()
    rows = flat.numel() // n
    indices = torch.empty(*scores.shape[:-1], k, dtype=torch.int64)
    values = torch.empty(*scores.shape[:-1], k, dtype=scores.dtype)
    threads = min(torch.get_num_threads(), rows) if rows * n >= TOPK_THREAD_FROM else 1
    heap = torch.empty(threads * n, dtype=torch.int64)
    lib.dsv41_topk(rows, n, k, sorted, threads, flat.data_ptr(), scores.dtype == torch.bfloat16, heap.data_ptr(),
                   indices.data_ptr(), values.data_ptr())
    return values, indices


def route(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float, eps: float,
          bias_vl: torch.Tensor | None = None, image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """moe.py `route` after the gate's logits (topk.c `dsv41_route`): fp32 CPU logits [n, E], bias and
    bias_vl [E] fp32, image [n] bool (bias_vl selects for its tokens) → (weights [n, k] fp32, ids [n, k]
    int64); None where the kernel is not available or does not take the call."""
    lib = _library()
    n, E = logits.shape
    if lib is None or logits.dtype != torch.float32 or not 0 < k <= E or n == 0:
        return None
    logits, bias = logits.contiguous(), bias.float().contiguous()
    vl = image_ptr = None
    if bias_vl is not None and image is not None:
        bias_vl, image = bias_vl.float().contiguous(), image.to(torch.bool).contiguous()
        vl, image_ptr = bias_vl.data_ptr(), image.data_ptr()
    ids, weights = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k, dtype=torch.float32)
    threads = min(torch.get_num_threads(), n) if n * E >= TOPK_THREAD_FROM else 1
    status = lib.dsv41_route(n, E, k, scale, eps, threads, logits.data_ptr(), bias.data_ptr(), vl, image_ptr,
                             ids.data_ptr(), weights.data_ptr())
    return (weights, ids) if status == 0 else None


_GEMV_DTYPES = (torch.bfloat16, torch.float32)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, exact: bool = False) -> bool:
    """out [P, M, N] = x [P, M, K] · w [P, N, K]ᵀ per pair (or one pair: [M, K], [N, K], [M, N]), for
    CPU tensors of bf16 or fp32 with unit innermost strides (any others: views are read and written in
    place): fp32 sums, or with `exact` exact products summed in double and rounded once (the invariant
    kernels' float64 product). False where the kernel is not available or does not take the call (then
    `out` is untouched)."""
    lib = _library()
    if lib is None or x.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    if x.dtype not in _GEMV_DTYPES or w.dtype not in _GEMV_DTYPES or out.dtype not in _GEMV_DTYPES:
        return False
    if x.dim() == 2:
        (M, K), N, P = x.shape, w.shape[0], 1
        x_sp = w_sp = o_sp = 0
        x_sm, w_sn, o_sm = x.stride(0), w.stride(0), out.stride(0)
    else:
        (P, M, K), N = x.shape, w.shape[1]
        (x_sp, x_sm, _), (w_sp, w_sn, _), (o_sp, o_sm, _) = x.stride(), w.stride(), out.stride()
    bf16 = torch.bfloat16
    threads = torch.get_num_threads() if P * N * K >= GEMV_THREAD_FROM else 1
    return lib.dsv41_gemv(P, M, N, K, x.dtype == bf16, w.dtype == bf16, out.dtype == bf16, exact, threads,
                          x.data_ptr(), x_sp, x_sm, w.data_ptr(), w_sp, w_sn, out.data_ptr(), o_sp, o_sm) == 0


def sparse_attention(q: torch.Tensor, pool: torch.Tensor | list[torch.Tensor], rows: torch.Tensor, sink: torch.Tensor,
                     scale: float, floor: float,
                     picked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """attention.py's `sparse_attention` without blocks (one fp32 softmax per query and head, with the
    sink): q [B, T, H, Dh] over the listed rows [B, T, n] (−1: none; the model's own indices, below
    N) of pool [B, N, Dh], bf16 or fp32, → q's dtype. For B = 1 the pool may be a list of parts [Nᵢ, Dh]
    of one dtype, read where they lie as if concatenated (a decode step's rings and its rows, N40), and
    `picked` = (kv [S, L, Dh], token_slot [M], selected [M, k]) one more part after them, read in its
    cache: its row t · k + j is kv[token_slot[t], selected[t, j]] (−1: none; such rows must not be
    listed). None where the kernel is not available or does not take the pool, or a picked row lies
    outside its cache."""
    lib = _library()
    parts = [p.contiguous() for p in ([pool] if torch.is_tensor(pool) else pool)]
    if picked is not None:
        kv, token_slot, selected = picked
        parts.append(kv.contiguous())
        token_slot, selected = token_slot.to(torch.int64).contiguous(), selected.to(torch.int64).contiguous()
    if lib is None or q.dtype not in _GEMV_DTYPES or parts[0].dtype not in _GEMV_DTYPES:
        return None
    (B, T, H, Dh), n = q.shape, rows.shape[-1]
    if len(parts) > 1 and (B != 1 or any(p.dtype != parts[0].dtype or p.shape[-1] != Dh for p in parts)):
        return None
    if picked is not None and (kv.dim() != 3 or token_slot.numel() * selected.shape[-1] != selected.numel()):
        return None
    sizes = [p.numel() // Dh for p in parts]
    if picked is not None:
        sizes[-1] = selected.numel()
    ends = list(itertools.accumulate(sizes))
    q, rows, sink = q.contiguous(), rows.to(torch.int64).contiguous(), sink.float().contiguous()
    out = torch.empty_like(q)
    threads = torch.get_num_threads() if B * T * H * n * Dh >= GEMV_THREAD_FROM and B * T > 1 else 1
    bf16 = torch.bfloat16
    status = lib.dsv41_sparse_attention(B, T, H, Dh, ends[-1] // B, n, threads, q.data_ptr(), q.dtype == bf16, len(parts),
                                        (ctypes.c_int64 * len(parts))(*(p.data_ptr() for p in parts)),
                                        (ctypes.c_int64 * len(parts))(*ends),
                                        *((selected.shape[-1], kv.shape[0], kv.shape[1], token_slot.data_ptr(),
                                           selected.data_ptr()) if picked is not None else (0, 0, 0, None, None)),
                                        parts[0].dtype == bf16, rows.data_ptr(),
                                        sink.data_ptr(), scale, floor, out.data_ptr(), out.dtype == bf16)
    return out if status == 0 else None


def gather_compressed(kv: torch.Tensor, token_slot: torch.Tensor, selected: torch.Tensor) -> torch.Tensor | None:
    """attention.py `Picked.rows` in one call (attention.c): kv [S, L, Dh] (contiguous), token_slot [N],
    selected [N, k] (−1: none) → picked [N·k, Dh]: token i's entry j at i·k + j, row 0 for −1. None where
    the kernel is not available or does not take the call."""
    lib = _library()
    if lib is None or not kv.is_contiguous() or kv.dim() != 3:
        return None
    token_slot, selected = token_slot.to(torch.int64).contiguous(), selected.to(torch.int64).contiguous()
    (N, k), (L, Dh) = selected.shape, kv.shape[1:]
    picked = kv.new_empty(N * k, Dh)
    status = lib.dsv41_gather_compressed(N, k, L, Dh * kv.element_size(), kv.data_ptr(), token_slot.data_ptr(),
                                         selected.data_ptr(), picked.data_ptr())
    return picked if status == 0 else None


def engram_rows(weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor | None:
    """engram/table.py's lookup on the host in one call (engram.c): weight e4m3 [rows, De] and scale
    ue8m0 [rows, De/32] of a table part starting at row `first`, ids int64 [...] of the whole table →
    bf16 [..., De] (zeros for ids outside the part), the torch path's values. None where the kernel is
    not available or does not take the table."""
    lib = _library()
    if (lib is None or weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float8_e8m0fnu
            or weight.dim() != 2 or weight.shape[1] % 32 or not (weight.is_contiguous() and scale.is_contiguous())):
        return None
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    rows, De = weight.shape
    out = torch.empty(flat.numel(), De, dtype=torch.bfloat16)
    threads = torch.get_num_threads() if out.numel() >= ENGRAM_THREAD_FROM else 1
    lib.dsv41_engram_rows(flat.numel(), rows, De, first, weight.data_ptr(), scale.data_ptr(), flat.data_ptr(),
                          threads, out.data_ptr())
    return out.view(*ids.shape, De)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """layers.py's RMSNorm of CPU rows x [..., D] (bf16 or fp32) with weight [D], fp32 statistics in
    this kernel's order → x's dtype; None where the kernel is not available."""
    lib = _library()
    if lib is None or x.dtype not in _GEMV_DTYPES or weight.dtype not in _GEMV_DTYPES or x.shape[-1] > 1 << 16:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    D = x.shape[-1]
    lib.dsv41_rms_norm(x.numel() // max(D, 1), D, eps, x.data_ptr(), x.dtype == torch.bfloat16, weight.data_ptr(),
                       weight.dtype == torch.bfloat16, out.data_ptr())
    return out


def exact_kn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [P, M, K] · w [P, K, N] → fp32 [P, M, N] for contiguous fp32 CPU tensors: exact products summed
    in double, rounded once (`gemv`'s exact mode with the weight K-major). None where the kernel is not
    available or could not run."""
    lib = _library()
    if lib is None or x.dtype != torch.float32 or w.dtype != torch.float32 or not (x.is_contiguous() and w.is_contiguous()):
        return None
    (P, M, K), N = x.shape, w.shape[2]
    out = torch.empty(P, M, N, dtype=torch.float32)
    threads = torch.get_num_threads() if P * M * N * K >= GEMV_THREAD_FROM else 1
    status = lib.dsv41_gemv_exact_kn(P, M, N, K, threads, x.data_ptr(), w.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def linear(x: torch.Tensor, w: torch.Tensor, exact: bool = False,
           out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x [..., K] · w [N, K]ᵀ → [..., N] in out_dtype (default x's): `gemv` of a contiguous x with one
    weight, without the views (each torch call here costs about a microsecond of a ~10 µs product).
    None where the kernel does not take the call."""
    lib = _library()
    if lib is None or not x.is_contiguous() or w.stride(-1) != 1:
        return None
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.dtype not in _GEMV_DTYPES or w.dtype not in _GEMV_DTYPES or out_dtype not in _GEMV_DTYPES:
        return None
    N, K = w.shape
    out = x.new_empty(*x.shape[:-1], N, dtype=out_dtype)
    bf16 = torch.bfloat16
    threads = torch.get_num_threads() if N * K >= GEMV_THREAD_FROM else 1
    status = lib.dsv41_gemv(1, x.numel() // K, N, K, x.dtype == bf16, w.dtype == bf16, out_dtype == bf16, exact,
                            threads, x.data_ptr(), 0, K, w.data_ptr(), 0, w.stride(0), out.data_ptr(), 0, N)
    return out if status == 0 else None


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """indexer.py's head-weighted ReLU scores of a key tile: q [B, T, H, D], weights [B, T, H], keys
    [B, C, D] (a column slice of the pool: rows contiguous) → [B, T, C], all bf16 or all fp32, with the
    torch path's roundings (indexer.c). None where the kernel is not available or does not take it."""
    lib = _library()
    if lib is None or q.dtype not in _GEMV_DTYPES or not (q.dtype == weights.dtype == keys.dtype):
        return None
    (B, T, H, D), C = q.shape, keys.shape[1]
    if keys.stride(-1) != 1 or (C > 1 and keys.stride(1) != D):
        return None
    q, weights = q.contiguous(), weights.contiguous()
    out = q.new_empty(B, T, C)
    threads = torch.get_num_threads() if B * T * C * H * D >= GEMV_THREAD_FROM else 1
    status = lib.dsv41_index_scores(B, T, H, D, C, q.dtype == torch.bfloat16, threads, q.data_ptr(), weights.data_ptr(),
                                    keys.data_ptr(), keys.stride(0), out.data_ptr())
    return out if status == 0 else None


def routed_experts(x: torch.Tensor, ids: torch.Tensor | None, weights: torch.Tensor | None, w1: torch.Tensor,
                   w3: torch.Tensor, w2: torch.Tensor, limit: float, into: torch.Tensor | None = None,
                   shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Σ over each token's chosen experts of w2 · (SwiGLU(w1 · x, w3 · x) · weight), fp32 [n, D], for CPU
    tensors: x [n, D], ids [n, A] (negative: not this rank's), weights [n, A], banks w1, w3 [E, I, D] and
    w2 [E, D, I] of one dtype (bf16 or fp32), held contiguous (2-d: one expert). ids and weights None:
    every token through expert 0 at weight 1. `into` (fp32 [n, D], contiguous): the sum is added to it,
    in place, and it is returned. `shared` (w1, w3 [I, D], w2 [D, I] in the banks' dtype, contiguous): the
    shared expert too, every token at weight 1, added after its routed experts (moe.py's order).
    `scales` (ue8m0 [E, I, D/32], [E, I, D/32], [E, D, I/32]): the banks are stored fp4 bytes (int8
    [E, I, D/2], [E, I, D/2], [E, D, I/2]), computed as the banks dequantised to `dtype` (bf16 or fp32)
    would be, with the same bits (gemv.c `fp4_rows`). None where the kernel is not available or does
    not take the call."""
    lib = _library()
    held = w1.dtype if scales is None else dtype
    banks = (w1, w3, w2) + (() if scales is None else scales)
    if lib is None or not all(w.is_contiguous() for w in banks + (shared or ())):
        return None
    if held not in (torch.bfloat16, torch.float32) or shared is not None and any(w.dtype != held for w in shared):
        return None
    if scales is None and not all(w.dtype == held for w in banks):
        return None
    if scales is not None and not (all(w.dtype == torch.int8 for w in (w1, w3, w2)) and w1.dim() == 3):
        return None
    if into is not None and not (into.dtype == torch.float32 and into.is_contiguous() and into.shape == x.shape):
        return None
    x = x.contiguous() if x.dtype in (torch.bfloat16, torch.float32) else x.float().contiguous()
    n, (E, I, D) = x.shape[0], (w1.shape if w1.dim() == 3 else (1, *w1.shape))
    if scales is not None:
        D *= 2
        if D % 32 or I % 32 or [tuple(c.shape) for c in scales] != [(E, I, D // 32), (E, I, D // 32), (E, D, I // 32)]:
            return None
    A, ids_ptr, weights_ptr, shared_ptrs = 1, None, None, (None, None, None)
    if ids is not None:
        ids, weights = ids.to(torch.int64).contiguous(), weights.float().contiguous()
        A, ids_ptr, weights_ptr = ids.shape[1], ids.data_ptr(), weights.data_ptr()
    if shared is not None:
        if ids is None or [tuple(w.shape) for w in shared] != [(I, D), (I, D), (D, I)]:
            return None
        shared_ptrs = tuple(w.data_ptr() for w in shared)
    out = torch.empty(n, D, dtype=torch.float32) if into is None else into
    threads = torch.get_num_threads() if n * A * I * D >= GEMV_THREAD_FROM else 1
    scale_ptrs = (None, None, None) if scales is None else tuple(c.data_ptr() for c in scales)
    status = lib.dsv41_routed_experts(n, A, E, D, I, held == torch.bfloat16, x.dtype == torch.bfloat16,
                                      limit, threads, x.data_ptr(), ids_ptr, weights_ptr,
                                      w1.data_ptr(), w3.data_ptr(), w2.data_ptr(), *shared_ptrs, *scale_ptrs,
                                      into is not None, out.data_ptr())
    return out if status == 0 else None


def fp4_rows(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A stored fp4 matrix (int8 [..., out, in/2], ue8m0 [..., out, in/32]) dequantised to `dtype` (bf16 or
    fp32) in one threaded pass: formats.dequantize_fp4_weight's values cast to `dtype`, the same bits. None
    where the kernel is not available or does not take the call."""
    lib = _library()
    if lib is None or dtype not in (torch.bfloat16, torch.float32) or packed.dtype != torch.int8:
        return None
    K = packed.shape[-1] * 2
    if K % 32 or tuple(scale.shape) != (*packed.shape[:-1], K // 32) or not (packed.is_contiguous() and scale.is_contiguous()):
        return None
    out = torch.empty(*packed.shape[:-1], K, dtype=dtype)
    rows = packed.shape[:-1].numel()
    threads = torch.get_num_threads() if rows * K >= GEMV_THREAD_FROM else 1
    lib.dsv41_fp4_rows(rows, K, dtype == torch.bfloat16, threads, packed.data_ptr(), scale.data_ptr(), out.data_ptr())
    return out


def split_mixes(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: int, iters: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """hyper.py `split_mixes` of fp32 CPU tensors in one call (mixes.c): m [..., (2 + S)·S] → pre
    [..., S], post [..., S], comb [..., S, S]; None where the kernel is not available or does not take
    the call (more than 4 streams)."""
    lib = _library()
    if lib is None or m.dtype != torch.float32:
        return None
    lead, S = m.shape[:-1], streams
    flat = m.reshape(-1, m.shape[-1]).contiguous()
    scale, base = scale.float().contiguous(), base.float().contiguous()
    pre, post = torch.empty(*lead, S), torch.empty(*lead, S)
    comb = torch.empty(*lead, S, S)
    status = lib.dsv41_split_mixes(flat.shape[0], S, iters, flat.data_ptr(), scale.data_ptr(), base.data_ptr(),
                                   eps, pre.data_ptr(), post.data_ptr(), comb.data_ptr())
    return (pre, post, comb) if status == 0 else None


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, norm_eps: float,
             hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """hyper.py `mixes` of CPU tensors in fast numerics' order, in one call (mixes.c): x [..., S, D] bf16 or
    fp32, fn [(2 + S)·S, S·D] fp32 → pre [..., S], post [..., S], comb [..., S, S]; None where the kernel
    is not available or does not take the call."""
    lib = _library()
    if lib is None or x.dtype not in _GEMV_DTYPES or fn.dtype != torch.float32:
        return None
    lead, (S, D) = x.shape[:-2], x.shape[-2:]
    x, fn = x.contiguous(), fn.contiguous()
    scale, base = scale.float().contiguous(), base.float().contiguous()
    pre, post, comb = torch.empty(*lead, S), torch.empty(*lead, S), torch.empty(*lead, S, S)
    rows = lead.numel()
    threads = torch.get_num_threads() if rows * fn.numel() >= GEMV_THREAD_FROM else 1
    status = lib.dsv41_hc_mixes(rows, S, D, x.dtype == torch.bfloat16, x.data_ptr(), fn.data_ptr(), scale.data_ptr(),
                                base.data_ptr(), iters, norm_eps, hc_eps, threads, pre.data_ptr(), post.data_ptr(),
                                comb.data_ptr())
    return (pre, post, comb) if status == 0 else None


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor | None:
    """hyper.py `collapse` of CPU tensors (mixes.c): x [..., S, D] bf16 or fp32, pre [..., S] fp32 →
    [..., D] in x's dtype; None where the kernel is not available."""
    lib = _library()
    if lib is None or x.dtype not in _GEMV_DTYPES:
        return None
    x, pre = x.contiguous(), pre.float().contiguous()
    S, D = x.shape[-2:]
    out = x.new_empty(*x.shape[:-2], D)
    lib.dsv41_hc_collapse(pre.numel() // S, S, D, x.dtype == torch.bfloat16, x.data_ptr(), pre.data_ptr(),
                          out.data_ptr())
    return out


def hc_expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor | None:
    """hyper.py `expand` of CPU tensors (mixes.c): out [..., D], residual [..., S, D] of one dtype (bf16
    or fp32), post [..., S], comb [..., S, S] fp32 → [..., S, D]; None where the kernel is not available."""
    lib = _library()
    if lib is None or out.dtype not in _GEMV_DTYPES or residual.dtype != out.dtype:
        return None
    out, residual = out.contiguous(), residual.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    S, D = residual.shape[-2:]
    streams = residual.new_empty(residual.shape)
    lib.dsv41_hc_expand(post.numel() // S, S, D, out.dtype == torch.bfloat16, out.data_ptr(), residual.data_ptr(),
                        post.data_ptr(), comb.data_ptr(), streams.data_ptr())
    return streams


def _entry(x, pre, fn, scale, base, norm_weight, out, post, comb) -> tuple | None:
    """`hc_enter`'s inputs as its kernel takes them (contiguous; the mixes fp32), or None where it does not."""
    if x.dtype not in _GEMV_DTYPES or fn.dtype != torch.float32 or norm_weight.dtype not in _GEMV_DTYPES:
        return None
    if x.shape[-1] > 1 << 16 or (out is not None and out.dtype != x.dtype):
        return None
    x, fn, pre = x.contiguous(), fn.contiguous(), pre.float().contiguous()
    scale, base, norm_weight = scale.float().contiguous(), base.float().contiguous(), norm_weight.contiguous()
    if out is not None:
        out, post, comb = out.contiguous(), post.float().contiguous(), comb.float().contiguous()
    return x, pre, fn, scale, base, norm_weight, out, post, comb


def _bf16_entry(x, pre, mixes, norm_weight, out, post, comb) -> tuple | None:
    """`_entry` of bf16 streams with the mixes' (fn, scale, base, …) as the block's fused calls take them."""
    return _entry(x, pre, *mixes[:3], norm_weight, out, post, comb) if x.dtype == torch.bfloat16 else None


def hc_enter(x: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             iters: int, norm_eps: float, hc_eps: float, norm_weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None, post: torch.Tensor | None = None, comb: torch.Tensor | None = None):
    """A sublayer's entry in one call (mixes.c `dsv41_hc_enter`): with `out` [..., D] (and the previous
    mixes' post, comb), `hc_expand(out, x, post, comb)` first; then `hc_mixes` of the streams and
    `rms_norm(hc_collapse(streams, pre), norm_weight, eps)`, with those functions' bits → (streams
    [..., S, D], (pre, post, comb) of this sublayer, h [..., D]). None where a part would decline."""
    lib = _library()
    if lib is None:
        return None
    entry = _entry(x, pre, fn, scale, base, norm_weight, out, post, comb)
    if entry is None:
        return None
    x, pre, fn, scale, base, norm_weight, out, post, comb = entry
    lead, (S, D) = x.shape[:-2], x.shape[-2:]
    streams, o_ptr, post_ptr, comb_ptr = x, None, None, None
    if out is not None:
        streams = torch.empty_like(x)
        o_ptr, post_ptr, comb_ptr = out.data_ptr(), post.data_ptr(), comb.data_ptr()
    pre_next, post_next, comb_next = torch.empty(*lead, S), torch.empty(*lead, S), torch.empty(*lead, S, S)
    h = x.new_empty(*lead, D)
    rows = lead.numel()
    threads = torch.get_num_threads() if rows * fn.numel() >= GEMV_THREAD_FROM else 1
    status = lib.dsv41_hc_enter(rows, S, D, x.dtype == torch.bfloat16, o_ptr, x.data_ptr(), post_ptr, comb_ptr,
                                streams.data_ptr(), fn.data_ptr(), scale.data_ptr(), base.data_ptr(), iters, norm_eps,
                                hc_eps, threads, pre.data_ptr(), norm_weight.data_ptr(),
                                norm_weight.dtype == torch.bfloat16, eps, pre_next.data_ptr(), post_next.data_ptr(),
                                comb_next.data_ptr(), h.data_ptr())
    return (streams, (pre_next, post_next, comb_next), h) if status == 0 else None


def rope(x: torch.Tensor, phases: torch.Tensor, inverse: bool = False) -> torch.Tensor | None:
    """rope.py `Rotary.rotate` of a CPU tensor (rope.c): x [B, T, (heads,) F] bf16 or fp32, phases
    complex64 [B or 1, T, R/2], contiguous (conjugated by the kernel for the inverse) → x's last R
    features rotated, in x's dtype; None where the kernel is not available or does not take the call."""
    lib = _library()
    if lib is None or x.dtype not in _GEMV_DTYPES or phases.dtype != torch.complex64 or x.dim() not in (3, 4):
        return None
    B, T, F = x.shape[0], x.shape[1], x.shape[-1]
    PB, R = phases.shape[0], 2 * phases.shape[-1]
    if phases.shape[1] != T or PB not in (1, B) or phases.is_conj() or not phases.is_contiguous():
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.dsv41_rope(B, T, x.shape[2] if x.dim() == 4 else 1, F, R, PB, x.dtype == torch.bfloat16, inverse,
                   x.data_ptr(), phases.data_ptr(), out.data_ptr())
    return out


def _bf16_rows(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def attention_in(x: torch.Tensor, wq_a: torch.Tensor, q_norm: torch.Tensor, q_eps: float, wq_b: torch.Tensor,
                 wkv: torch.Tensor, kv_norm: torch.Tensor, kv_eps: float, phases: torch.Tensor, heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A decode step's query and key paths in one call (sublayers.c `dsv41_attention_in`): x [1, N, D]
    bf16 → (qr = q_norm(x · wq_aᵀ) [1, N, Qr], q = RoPE(qr · wq_bᵀ) [1, N, H, Dh], kv = RoPE(kv_norm(x ·
    wkvᵀ)) [1, N, Dh]), the bits of `linear`, `rms_norm` and `rope` one by one. Weights bf16, norms bf16
    or fp32, phases complex64 [N, R/2]. None where the kernel is not available or does not take the call."""
    lib = _library()
    if lib is None:
        return None
    paths = _paths(x.shape[:-1], x.shape[-1], x.dtype, wq_a, q_norm, q_eps, wq_b, wkv, kv_norm, kv_eps, phases, heads)
    if paths is None:
        return None
    sizes, weights, outputs = paths
    x = x.contiguous()
    status = lib.dsv41_attention_in(x.numel() // x.shape[-1], x.shape[-1], *sizes, torch.get_num_threads(), x.data_ptr(),
                                    *_pointers(weights), *(t.data_ptr() for t in outputs))
    return outputs if status == 0 else None


def _paths(lead: torch.Size, D: int, dtype: torch.dtype, wq_a, q_norm, q_eps, wq_b, wkv, kv_norm, kv_eps, phases,
           heads) -> tuple[list, list, tuple] | None:
    """`attention_in`'s checks for rows [*lead, D] → (its sizes Qr, H, Dh, R; its weights' arguments; the
    outputs qr, q, kv it writes), or None where the kernel does not take them."""
    if not _bf16_rows(wq_a, wq_b, wkv) or dtype != torch.bfloat16 or phases.dtype != torch.complex64:
        return None
    (Qr, D_in), (HD, Dh) = wq_a.shape, (wq_b.shape[0], wkv.shape[0])
    N, R = lead.numel(), 2 * phases.shape[-1]
    if (D, wq_b.shape[1], wkv.shape[1], HD, q_norm.numel(), kv_norm.numel()) != (D_in, Qr, D_in, heads * Dh, Qr, Dh):
        return None
    if phases.numel() * 2 != N * R or R > Dh or phases.is_conj() or not phases.is_contiguous():
        return None
    if q_norm.dtype not in _GEMV_DTYPES or kv_norm.dtype not in _GEMV_DTYPES:
        return None
    bf16 = torch.bfloat16
    outputs = (torch.empty(*lead, Qr, dtype=bf16), torch.empty(*lead, heads, Dh, dtype=bf16), torch.empty(*lead, Dh, dtype=bf16))
    weights = [wq_a, q_norm.contiguous(), q_norm.dtype == bf16, q_eps, wq_b, wkv, kv_norm.contiguous(), kv_norm.dtype == bf16,
               kv_eps, phases]
    return [Qr, heads, Dh, R], weights, outputs


def _pointers(args: list) -> list:
    """Arguments for a kernel: each tensor's address, None as NULL (the caller keeps the tensors alive
    through the call)."""
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


def attention_entry(x: torch.Tensor, pre: torch.Tensor, mixes: tuple, norm: tuple[torch.Tensor, float],
                    projections: tuple) -> tuple | None:
    """A block's way into its attention for decode rows in one call (sublayers.c `dsv41_attention_entry`):
    the streams x [..., S, D] bf16 with pre [..., S] (trap 1), the attention's mixes `mixes` = (fn, scale,
    base, iters, norm eps, hc eps) and `norm` (attn_norm's weight, eps), then `attention_in`'s arguments
    after its rows (`projections`) → ((pre, post, comb) of the attention's mixes, h [..., D], (qr, q, kv)
    [..., …]): the bits of `hc_enter` and `attention_in` one by one. None where a part would decline."""
    lib = _library()
    entry = None if lib is None else _bf16_entry(x, pre, mixes, norm[0], None, None, None)
    if entry is None:
        return None
    x, pre, fn, scale, base, norm_weight, _, _, _ = entry
    iters, norm_eps, hc_eps = mixes[3:]
    lead, (S, D) = x.shape[:-2], x.shape[-2:]
    paths = _paths(lead, D, x.dtype, *projections)
    if paths is None:
        return None
    sizes, weights, outputs = paths
    n = lead.numel()
    mixed = (torch.empty(*lead, S), torch.empty(*lead, S), torch.empty(*lead, S, S))
    h = x.new_empty(*lead, D)
    threads = torch.get_num_threads()
    status = lib.dsv41_attention_entry(n, S, D, x.data_ptr(), fn.data_ptr(), scale.data_ptr(), base.data_ptr(), iters,
                                       norm_eps, hc_eps, threads if n * fn.numel() >= GEMV_THREAD_FROM else 1,
                                       pre.data_ptr(), norm_weight.data_ptr(), norm_weight.dtype == torch.bfloat16,
                                       norm[1], *(t.data_ptr() for t in mixed), h.data_ptr(), *sizes, threads,
                                       *_pointers(weights), *(t.data_ptr() for t in outputs))
    return (mixed, h, outputs) if status == 0 else None


def attention_out(o: torch.Tensor, phases: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor) -> torch.Tensor | None:
    """A decode step's way out of the attention in one call (sublayers.c `dsv41_attention_out`): o [1, N,
    H, Dh] bf16 rotated back, its G groups through wo_a [G, Or, H·Dh/G], then wo_b [D, G·Or] → [1, N, D]
    bf16 (before any tensor-parallel all-reduce), the bits of `rope`, `gemv` and `linear` one by one.
    None where the kernel is not available or does not take the call."""
    lib = _library()
    if lib is None or not _bf16_rows(o, wo_a, wo_b) or phases.dtype != torch.complex64 or o.dim() != 4 or wo_a.dim() != 3:
        return None
    if o.shape[0] != 1:
        return None
    (_, N, H, Dh), (G, Or, I), (D, K) = o.shape, wo_a.shape, wo_b.shape
    R = 2 * phases.shape[-1]
    if G * I != H * Dh or K != G * Or or phases.numel() * 2 != N * R or R > Dh or phases.is_conj() \
            or not phases.is_contiguous():
        return None
    y = o.new_empty(1, N, D)
    status = lib.dsv41_attention_out(N, H, Dh, R, G, Or, D, torch.get_num_threads(), o.data_ptr(), phases.data_ptr(),
                                     wo_a.data_ptr(), wo_b.data_ptr(), y.data_ptr())
    return y if status == 0 else None


def moe(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, k: int, scale: float, eps: float, limit: float,
        banks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's MoE in one call (sublayers.c `dsv41_moe`): x [n, D] bf16 → (the routed experts'
    sum plus the shared expert's, rounded to bf16 [n, D], the chosen ids [n, k]), the bits of
    `linear` (the gate widened), `route` and `routed_experts` one by one. gate [E, D] bf16, bias [E]
    fp32; banks w1, w3 [E, I, D], w2 [E, D, I] bf16, or (with `scales`) fp4 bytes; shared w1, w3 [I, D],
    w2 [D, I] bf16. None where the kernel is not available or does not take the call."""
    lib = _library()
    if lib is None:
        return None
    experts = _experts(x.shape[-1], gate, bias, k, banks, shared, scales)
    if experts is None or not _bf16_rows(x) or x.dim() != 2:
        return None
    (n, D), (E, I) = x.shape, banks[0].shape[:2]
    ids, weights, y = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k), x.new_empty(n, D)
    status = lib.dsv41_moe(n, D, E, k, I, torch.get_num_threads(), x.data_ptr(), gate.data_ptr(), bias.data_ptr(),
                           scale, eps, limit, *experts, ids.data_ptr(), weights.data_ptr(), y.data_ptr())
    return (y, ids) if status == 0 else None


def _experts(D: int, gate, bias, k, banks, shared, scales) -> list | None:
    """`moe`'s checks of its weights for rows of D values → the kernel's pointers to the banks, the
    shared expert and the scales (None for held banks), or None where it does not take them."""
    w1, w3, w2 = banks
    if not _bf16_rows(gate, *shared) or bias.dtype != torch.float32 or not bias.is_contiguous():
        return None
    if not all(w.is_contiguous() and w.dim() == 3 for w in banks):
        return None
    E, I = w1.shape[:2]
    held = torch.bfloat16 if scales is None else torch.int8
    per_byte = 1 if scales is None else 2                                   # fp4: two values a byte
    tensors, expected = [gate, bias, w1, w3, w2, *shared], [(E, D), (E,), (E, I, D // per_byte), (E, I, D // per_byte),
                                                          (E, D, I // per_byte), (I, D), (I, D), (D, I)]
    if scales is not None:
        if D % 32 or I % 32 or not all(c.is_contiguous() for c in scales):
            return None
        tensors, expected = tensors + list(scales), expected + [(E, I, D // 32), (E, I, D // 32), (E, D, I // 32)]
    if any(w.dtype != held for w in banks) or [tuple(t.shape) for t in tensors] != expected or not 0 < k <= E:
        return None
    pointers = [w.data_ptr() for w in (*banks, *shared)]
    return pointers + ([None] * 3 if scales is None else [c.data_ptr() for c in scales])


def ffn_half(x: torch.Tensor, pre: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             mixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float, float],
             norm: tuple[torch.Tensor, float], gate: torch.Tensor, bias: torch.Tensor, k: int, scale: float, eps: float,
             limit: float, banks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """A block's feed-forward half for decode rows in one call (sublayers.c `dsv41_ffn_half`): the streams
    x [..., S, D] bf16 with the attention's output `out` [..., D] (its post and comb), the FFN's mixes
    `mixes` = (fn, scale, base, Sinkhorn iterations, norm eps, hc eps) and `norm` (ffn_norm's weight,
    eps) → (streams [..., S, D], the FFN's pre [..., S], the chosen ids [n, k]): the bits of `hc_enter`,
    `moe` and `hc_expand` one by one. None where a part would decline."""
    lib = _library()
    entry = None if lib is None else _bf16_entry(x, pre, mixes, norm[0], out, post, comb)
    if entry is None:
        return None
    x, pre, fn, mix_scale, base, norm_weight, out, post, comb = entry
    iters, norm_eps, hc_eps = mixes[3:]
    (lead, (S, D)), (E, I) = (x.shape[:-2], x.shape[-2:]), banks[0].shape[:2]
    experts = _experts(D, gate, bias, k, banks, shared, scales)
    if experts is None or out.shape != (*lead, D):
        return None
    n = lead.numel()
    pre_next, ids, weights = torch.empty(*lead, S), torch.empty(n, k, dtype=torch.int64), torch.empty(n, k)
    streams = torch.empty_like(x)
    threads = torch.get_num_threads()
    status = lib.dsv41_ffn_half(n, S, D, out.data_ptr(), x.data_ptr(), post.data_ptr(), comb.data_ptr(), fn.data_ptr(),
                                mix_scale.data_ptr(), base.data_ptr(), iters, norm_eps, hc_eps,
                                threads if n * fn.numel() >= GEMV_THREAD_FROM else 1, pre.data_ptr(),
                                norm_weight.data_ptr(), norm_weight.dtype == torch.bfloat16, norm[1], E, k, I, threads,
                                gate.data_ptr(), bias.data_ptr(), scale, eps, limit, *experts, pre_next.data_ptr(),
                                ids.data_ptr(), weights.data_ptr(), streams.data_ptr())
    return (streams, pre_next, ids) if status == 0 else None


def qdq(x: torch.Tensor, point: str) -> torch.Tensor | None:
    """formats.fp8_qdq(x, 32) ("window") or formats.fp4_qdq_e8m0(x, 32) ("index") of a CPU tensor
    (quantize.c), in x's dtype; None where the kernel is not available."""
    lib = _library()
    if lib is None or x.dtype not in _GEMV_DTYPES or x.shape[-1] % formats.FP8_WEIGHT_BLOCK:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    K, bf16 = x.shape[-1], x.dtype == torch.bfloat16
    if point == "window":
        e4m3 = _tables()[0]
        status = lib.dsv41_fp8_qdq(x.numel() // K, K, bf16, x.data_ptr(), formats.ACT_AMAX_FLOOR,
                                   formats.INV_FP8_MAX_F32, e4m3.data_ptr(), out.data_ptr())
        return out if status == 0 else None
    lib.dsv41_fp4_qdq_e8m0(x.numel() // K, K, bf16, x.data_ptr(), formats.FP4_E8M0_AMAX_FLOOR,
                           formats.INV_FP4_MAX_F32, out.data_ptr())
    return out


def _row_addresses(rows: torch.Tensor, slots: list[int], positions: list[int]) -> torch.Tensor:
    """int64 [n]: the address of rows[slots[i], positions[i]] (a [slots, length, width] cache tensor whose
    rows are contiguous; the caller checks the bounds), for the kernels below, which read or write rows
    of several slots."""
    step, at = rows.element_size(), rows.data_ptr()
    return torch.tensor([at + (s * rows.stride(0) + p * rows.stride(1)) * step for s, p in zip(slots, positions)],
                        dtype=torch.int64)


def publish(x: torch.Tensor | None, wkv: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
            latent: torch.Tensor | None, wk: torch.Tensor, k_norm: torch.Tensor, k_eps: float, phases: torch.Tensor,
            kv: torch.Tensor, index_keys: torch.Tensor, slots: list[int], rows: list[int]) -> bool:
    """A kv source's new compressed rows in one call (compressed.c `dsv41_publish`): from the latents
    [G, Dh] pre-RoPE, or for r = 1 from the tokens x [G, D] (latent = RMSNorm(x · wkvᵀ, norm, eps)), the
    row RoPE(latent) written to kv[slots[i], rows[i]] and the index key RoPE(RMSNorm(latent · wkᵀ, k_norm,
    k_eps)) to index_keys[slots[i], rows[i]] (bf16 caches; the caller checks the bounds), the bits of the
    calls one by one; phases complex64 [G, R/2]. False where the kernel is not available or does not
    take the call (nothing written)."""
    lib = _library()
    if lib is None:
        return False
    source = latent if x is None else x
    if source.dtype != torch.bfloat16 or phases.dtype != torch.complex64 or not _bf16_rows(wk):
        return False
    if x is not None and not (_bf16_rows(wkv) and norm.dtype in _GEMV_DTYPES):
        return False
    (Di, Dh), G = wk.shape, len(rows)
    D = 0 if x is None else wkv.shape[1]
    R = 2 * phases.shape[-1]
    if (x is not None and (x.shape[-1], wkv.shape[0], norm.numel()) != (D, Dh, Dh)) or source.numel() != G * (D or Dh):
        return False
    if k_norm.dtype not in _GEMV_DTYPES or k_norm.numel() != Di or phases.numel() * 2 != G * R or R > min(Dh, Di):
        return False
    if phases.is_conj() or not phases.is_contiguous() or len(slots) != G:
        return False
    kv_rows, key_rows = _row_addresses(kv, slots, rows), _row_addresses(index_keys, slots, rows)
    bf16 = torch.bfloat16
    # the tensors whose addresses the kernel reads stay referenced here through the call
    source, k_norm = source.contiguous(), k_norm.contiguous()
    norm = None if x is None else norm.contiguous()
    tokens, latent = (None, source) if x is None else (source, None)
    return lib.dsv41_publish(G, D, Dh, Di, R, torch.get_num_threads(), *_pointers([tokens, wkv, norm]),
                             norm is not None and norm.dtype == bf16, eps, *_pointers([latent, wk, k_norm]),
                             k_norm.dtype == bf16, k_eps, *_pointers([phases, kv_rows, key_rows])) == 0


def index_select(x: torch.Tensor, qr: torch.Tensor, wq_b: torch.Tensor, weights_proj: torch.Tensor, scale: float,
                 phases: torch.Tensor, keys: list[tuple[torch.Tensor, int]], C: int, visible: torch.Tensor, topk: int,
                 blocks: tuple[int, int] | None, restrict: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A decode step's choice of compressed positions in one call (compressed.c `dsv41_index_select`): x
    [.., N, D] and qr [.., N, Qr] bf16 (one token per row), each token's index keys [C, Di] (`keys`: per
    token a cache's bf16 index_keys [slots, ≥ C, Di] and its slot; the caller checks the bounds), visible
    [N] → (chosen [N, min(topk, C)] int64 ascending, −1 for none; with `blocks` = (Nb, Bs) the candidate
    source's kept-block mask [N, C] bool, else None); restrict [.., N, C] bool: a candidate user's mask.
    The bits of the indexer's calls one by one. None where the kernel is not available or does not take
    the call."""
    lib = _library()
    if lib is None or not _bf16_rows(wq_b, weights_proj) or x.dtype != torch.bfloat16 or qr.dtype != torch.bfloat16:
        return None
    (HD, Qr), (Hi, D) = wq_b.shape, weights_proj.shape
    N, R = x.numel() // D, 2 * phases.shape[-1]
    if HD % Hi or qr.numel() != N * Qr or x.shape[-1] != D or len(keys) != N or visible.numel() != N:
        return None
    Di = HD // Hi
    if C < 1 or topk < 1 or phases.numel() * 2 != N * R or R > Di or phases.is_conj() or not phases.is_contiguous():
        return None
    if restrict is not None and (restrict.dtype != torch.bool or restrict.numel() != N * C):
        return None
    if blocks is not None and min(blocks) < 1:
        return None
    key_rows = torch.tensor([t.data_ptr() + s * t.stride(0) * t.element_size() for t, s in keys], dtype=torch.int64)
    # the tensors whose addresses the kernel reads stay referenced here through the call
    x, qr, visible = x.contiguous(), qr.contiguous(), visible.to(torch.int64).contiguous()
    restrict = None if restrict is None else restrict.contiguous()
    chosen = torch.empty(N, min(topk, C), dtype=torch.int64)
    keep = None if blocks is None else torch.empty(N, C, dtype=torch.bool)
    Nb, Bs = blocks or (0, 0)
    status = lib.dsv41_index_select(N, D, Qr, Hi, Di, R, C, topk, Nb, Bs, torch.get_num_threads(),
                                    *_pointers([x, qr, wq_b, weights_proj]), scale,
                                    *_pointers([phases, key_rows, visible, restrict, keep, chosen]))
    return (chosen, keep) if status == 0 else None
