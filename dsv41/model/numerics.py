"""The numerics policy: which number formats a model computes in and which kernels compute it.

Shapes: M rows (positions), K reduction width, N outputs, nb = K / 32 quantisation blocks.

One frozen object, built from the runtime config and passed to every module (STYLE.md P2, A1):

- `mode` "reference" keeps fp8 / fp4 weights quantised, quantises activations before every quantised
  GEMM, applies the three attention QDQ points and rounds attention probabilities per block of 64, as
  the public reference does (docs/ARCHITECTURE.md §6); "fast" holds dequantised weights and skips all of it.
- `kernels` decides how a product-sum is reduced:
  - "invariant": every matmul is reduced in float64 and rounded once to its output precision. The
    operands of the model's matmuls are bf16 values or quantised values, whose products are exact in
    float64 and whose sums are exact or within 2⁻⁵³ of it, so the result does not depend on the order in
    which a library sums, and thus not on how many rows the call has: a position gives the same bits in
    a prefill, a chunk, a decode step, a verify pass or a batch (docs/NUMERICS.md N1). Transcendental functions (exp,
    sigmoid, silu, softplus) are evaluated in float64 too: the CPU kernels compute the tail of a tensor
    that does not fill a SIMD vector with scalar code that differs in the last bit, so an element's fp32
    result depended on the tensor's size (N2). Attention lists have one canonical layout per query position
    (`attention.py`).
  - "blas": each call's matmuls go to the BLAS at the call's shape, the way the public reference runs
    them. Faster, and with reference numerics bit-identical to the reference's CPU port on the calls the
    reference supports; but the BLAS sums a 1-row call in another order than a 6-row one, so results
    move in the last bit with the call shape (trap 23).
- `experts` decides how the routed experts run (moe.py):
  - "loop": each expert that has rows runs once over all of them, reading its weights in place. On the
    CPU the group offsets are host memory already, and a decode step reads only the chosen experts'
    weights, never a gathered copy of them.
  - "grouped": one grouped GEMM per projection with device-side offsets (no host synchronisation); the
    accelerators' choice, fast numerics with BLAS kernels only.
  `for_device` picks it from the device the model runs on.
- `cpu_kernels` (fast numerics with BLAS kernels on the CPU, set by `for_device`): the CPU's own choice
  of kernel where torch's default is slow at decode sizes (docs/NUMERICS.md N10; benchmarks/bench_kernels.py):
  - products of two bf16 activations (the index scores) run on fp32 copies and round back to bf16:
    the bf16 path goes through oneDNN, which builds a kernel for every new shape (~0.7 ms; the key count
    grows every decode step) and runs small products 2–8× slower than the fp32 BLAS;
  - the hyper-connection mixes of fewer than `hyper.INNERMOST_FROM` rows (their gates and Sinkhorn)
    run in NumPy (hyper.py): Sinkhorn's 120 steps on 4×4 matrices cost a fixed ~4 µs each as torch
    ops, ~1.3 µs as NumPy ones.
  Both sum in another order than the default path, which fast numerics with BLAS kernels allow.
- `native` (on the CPU, set by `for_device` where the C library builds: `native/`):
  - reference numerics with invariant kernels (docs/NUMERICS.md N11, N13, N14): every quantised GEMM
    (a decode step's rows one by one, a prefill's in register tiles) and every activation quantisation
    before one run in C from the stored bytes, with the torch path's bits exactly (exact block sums),
    so they may mix with it freely; so do the float64 products of at most `NATIVE_GEMV_ROWS` rows
    (`linear`: the head, the hyper-connection mixes; wo_a's groups) and attention's products, as exact
    products summed in double;
  - fast numerics with BLAS kernels (N12, N17–N19): products of at most `NATIVE_GEMV_ROWS` rows
    (`NATIVE_WIDE_ROWS` where the build multiplies in wide tiles) with a bf16 weight or a large fp32
    one (linears, the head, the held experts, wo_a's groups), the routed experts of at most
    `NATIVE_EXPERT_PAIRS` (token, expert) pairs, a decode step's sparse attention, index scores and
    RMSNorms, run in C, outside autograd only (the kernels have no backward);
  - both: the hyper-connection mixes, RoPE and the tie-ruled top-k (N13, N15, N16).
- `stored_experts` (fast numerics on the CPU, from `RuntimeConfig.stored_experts`): fp4 routed experts
  stay in their stored bytes; the native expert kernel decodes each tile of rows just before its
  products, and the torch path dequantises one expert at a time, so every result has the bits of the
  experts held dequantised (docs/NUMERICS.md N30).
- `triton` (fast numerics with BLAS kernels on CUDA, set by `for_device` where Triton imports):
  the hyper-connection split, Sinkhorn included, in one launch instead of ~120 (`gpu_kernels.py`;
  docs/NUMERICS.md N28).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from . import formats, gpu_kernels, native
from .topk import topk as ordered_topk
from ..config import ConfigError

MODES = ("reference", "fast")
KERNELS = ("invariant", "blas")
EXPERT_KERNELS = ("loop", "grouped")
# The reference kernel walks an attention list in blocks of 64 indices (§11.7, kernel.py `block`).
ATTENTION_BLOCK = 64
# Quantised GEMMs sum each 32-wide K block on its own (§6.3: one activation scale per 32 inputs).
GEMM_BLOCK = 32
# Largest float64 weight copy an invariant matmul makes at once (the head is 129280 × 4096). Above
# glibc's largest mmap threshold (32 MB) every call's copy is fresh pages, faulted in one by one: the
# demo-sized head (8192 × 512) converted in 21.6 ms in one piece and in 2.2 ms in pieces of 8 MB.
FLOAT64_CHUNK_ELEMENTS = 1 << 20
# Weight values an invariant quantised GEMM decodes at once: a piece that stays in the cache between
# its decode and its product, instead of the whole weight written out and read back.
DECODE_CHUNK_ELEMENTS = 1 << 17
# Stored bytes fewer than this decode by torch's cast (one op) rather than the table lookup (several).
CAST_BELOW = 1 << 14
# Largest batch of per-block partial sums an invariant quantised GEMM holds at once.
BLOCK_PARTIALS_ELEMENTS = 1 << 23
# Most activation rows fast numerics' native product takes per weight (docs/NUMERICS.md N12): ~8 µs
# per call against torch's 26–33 µs for a bf16 decode-sized weight; past a few rows oneDNN's blocked
# kernel catches up.
NATIVE_GEMV_ROWS = 4
# Most rows fast numerics' native product takes where it multiplies in wide tiles (N12): bf16 operands
# with AVX512-BF16 dot products, or a large fp32 weight with AVX-512 (`native.wide_products`). At 16
# rows a 512 × 512 bf16 weight takes 107 µs against oneDNN's 169, the 8192 × 512 fp32 head 2.2 ms
# against MKL's 4.6; at 32 rows they are even on a 1536 × 512 weight.
NATIVE_WIDE_ROWS = 32
# Fewest values of an fp32 weight fast numerics' native product takes: MKL's fp32 GEMV streams a
# large weight at ~15 GB/s here (the 8192 × 512 head 719 µs, native 201 µs) and wins below ~1M values
# (a 24 × 2048 mix projection 5.6 µs against 11 µs).
NATIVE_FP32_FROM = 1 << 20
# Most rows whose hyper-connection mixes (Sinkhorn, hc_pre, hc_post) run natively, on one thread:
# from 1 to 512 rows 2–8× faster than torch's ops on two (docs/NUMERICS.md N16); a cap for long
# prefills on many cores, where torch's threads would gain (not measured here).
NATIVE_MIX_ROWS = 1 << 12
# Most positions whose RoPE and QDQ points run natively: the rotation matches torch's from 16 rows up.
NATIVE_POSITIONS = 64
# Vocabulary rows of a bf16 head widened to fp32 at a time where the native product does not take the
# call (the logits of many rows): 84 MB of fp32 at the released dim, not the 2.6 GB of the whole head.
HEAD_WIDEN_ROWS = 1 << 12
# Most (token, expert) pairs fast numerics' native routed experts take in one call (a batch of
# decode rows): past it a prefill's experts have enough rows each for the BLAS.
NATIVE_EXPERT_PAIRS = 128


@dataclass(frozen=True)
class Numerics:
    mode: str = "reference"
    kernels: str = "invariant"
    experts: str = "loop"
    cpu_kernels: bool = False
    native: bool = False
    triton: bool = False
    stored_experts: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"numerics must be one of {MODES}, got {self.mode!r}")
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.experts not in EXPERT_KERNELS:
            raise ConfigError(f"experts must be one of {EXPERT_KERNELS}, got {self.experts!r}")
        if self.experts == "grouped" and (self.quantized or self.invariant):
            # the grouped GEMM sums in its own order: only fast numerics with BLAS kernels may take it
            raise ConfigError(f"the grouped expert GEMM needs fast numerics with BLAS kernels, not "
                              f"{self.mode}/{self.kernels}")
        if self.native and self.quantized != self.invariant:
            # the blockwise GEMM sums each block exactly (the bits of invariant kernels); the dense
            # product sums in its own order (fast numerics' licence): neither fits a mixed policy
            raise ConfigError(f"the native kernels compute reference numerics with invariant kernels or fast "
                              f"numerics with BLAS kernels, not {self.mode}/{self.kernels}")
        if self.stored_experts and (self.quantized or self.experts != "loop"):
            # reference numerics hold them stored anyway; the grouped GEMM multiplies held banks
            raise ConfigError(f"stored experts are for fast numerics with the expert loop, not "
                              f"{self.mode} numerics with {self.experts} experts")
        for kind, chosen in (("CPU", self.cpu_kernels), ("Triton", self.triton)):
            if chosen and (self.quantized or self.invariant):
                raise ConfigError(f"the {kind} kernels sum in their own order: fast numerics with BLAS kernels only, "
                                  f"not {self.mode}/{self.kernels}")

    @classmethod
    def default(cls, mode: str) -> "Numerics":
        """Reference numerics default to invariant kernels (the engine's guarantees rest on them);
        fast numerics to the BLAS (speed first)."""
        return cls(mode, "invariant" if mode == "reference" else "blas")

    @classmethod
    def for_device(cls, mode: str, kernels: str | None, device: str, dtype: str = "bfloat16", *,
                   stored_experts: bool = False) -> "Numerics":
        """The policy of a model on `device`: kernels as given (None: `default`); reference numerics with
        invariant kernels on the CPU take the native blockwise GEMM where it builds; when fast numerics
        run BLAS kernels, the grouped expert GEMM on accelerators in bf16 (their grouped kernels take
        bf16) and the CPU kernels on the CPU, with the native dense product where it builds.
        `stored_experts` (fast numerics, CPU or meta only) keeps fp4 routed experts stored."""
        policy = cls.default(mode) if kernels is None else cls(mode, kernels)
        kind = torch.device(device).type
        if stored_experts:
            if kind not in ("cpu", "meta"):
                raise ConfigError(f"stored experts are decoded by the CPU kernels; on {device} hold them "
                                  "dequantised (stored_experts=False)")
            return replace(cls.for_device(mode, kernels, device, dtype), stored_experts=True)
        if policy.quantized and policy.invariant and kind == "cpu" and native.available():
            return cls(policy.mode, policy.kernels, native=True)
        if policy.quantized or policy.invariant:
            return policy
        if kind == "cpu":
            return cls(policy.mode, policy.kernels, cpu_kernels=True, native=native.available())
        if kind == "meta":
            return policy
        experts = "grouped" if dtype == "bfloat16" else "loop"
        return cls(policy.mode, policy.kernels, experts, triton=kind == "cuda" and gpu_kernels.available())

    # ------------------------------------------------------------------------------ properties
    @property
    def quantized(self) -> bool:
        """fp8 / fp4 weights stay quantised and activations are quantised before their GEMMs."""
        return self.mode == "reference"

    @property
    def invariant(self) -> bool:
        return self.kernels == "invariant"

    @property
    def grouped_experts(self) -> bool:
        return self.experts == "grouped"

    @property
    def host_mixes(self) -> bool:
        """Hyper-connection mixes (Sinkhorn included) of few rows in NumPy (hyper.py); not while
        torch.compile traces (NumPy on fake tensors breaks the graph; docs/NUMERICS.md N22)."""
        return self.cpu_kernels and not torch.compiler.is_compiling()

    @property
    def reference_order(self) -> bool:
        """Reductions keep the reference's layout and summation order (hc_post, Sinkhorn); otherwise the
        policy picks the faster formulation of the same sums."""
        return self.quantized or self.invariant

    @property
    def rows_alone(self) -> bool:
        """Under reference numerics with BLAS kernels, a batched call's compressor runs each row's
        products at the shapes of that row alone, as the reference's one-row calls do (N1). Exact-sum
        kernels give a row its solo bits at any shape, and fast BLAS numerics keep no bits, so both
        run a call's rows together."""
        return self.quantized and not self.invariant

    @property
    def attention_block(self) -> int | None:
        """Indices per online-softmax block; None = one exact softmax over the whole list."""
        return ATTENTION_BLOCK if self.quantized or self.invariant else None

    @property
    def round_probabilities(self) -> bool:
        """Attention probabilities rounded to bf16 before P·V, as the reference kernel does (§11.7)."""
        return self.quantized

    # ------------------------------------------------------------------------------ QDQ points (§6.4)
    def qdq_window(self, x: torch.Tensor) -> torch.Tensor:
        """Point #2: window KV (and DSpark KV), fp8 in blocks of 32 with ue8m0 scales (natively for a
        decode step's few rows: the same values, docs/NUMERICS.md N13)."""
        if not self.quantized:
            return x
        native_qdq = self._native_qdq(x, "window")
        return formats.fp8_qdq(x, 32) if native_qdq is None else native_qdq

    def qdq_compressed(self, x: torch.Tensor) -> torch.Tensor:
        """Point #3: compressed KV, fp4 in blocks of 16 with e4m3 scales."""
        return formats.fp4_qdq_e4m3(x, 16) if self.quantized else x

    def qdq_index(self, x: torch.Tensor) -> torch.Tensor:
        """Point #4: indexer queries and keys, fp4 in blocks of 32 with ue8m0 scales (natively likewise)."""
        if not self.quantized:
            return x
        native_qdq = self._native_qdq(x, "index")
        return formats.fp4_qdq_e8m0(x, 32) if native_qdq is None else native_qdq

    def _native_qdq(self, x: torch.Tensor, point: str) -> torch.Tensor | None:
        """x [B, T, …]: at most `NATIVE_POSITIONS` positions on the CPU, no autograd recording."""
        if not (self.native and x.is_cpu and x.dim() >= 3 and x.shape[:2].numel() <= NATIVE_POSITIONS):
            return None
        if torch.is_grad_enabled() and x.requires_grad:
            return None
        return native.qdq(x, point)

    def quantized_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str,
                         pairs: bool) -> torch.Tensor | None:
        """layers.py's quantised linear (or, with `pairs`, one weight per row of x [P, in]) in one native
        call from the stored weight and scale bytes: bf16, the torch path's bits (docs/NUMERICS.md N11,
        N14). None where the policy leaves it to layers.py."""
        if not (self.native and self.quantized and x.is_cpu):
            return None
        return native.quantized_linear(x, weight, scale, storage, pairs)

    def fp8_act_quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """§6.3 point #1 before a quantised GEMM: `formats.fp8_act_quant`, in one pass by the native
        kernel where the policy takes it (the same bytes and scales: tests/test_native.py)."""
        if self.native and x.is_cpu:
            out = native.fp8_act_quant(x)
            if out is not None:
                return out
        return formats.fp8_act_quant(x.float())

    # ------------------------------------------------------------------------------ elementwise
    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return self._elementwise(torch.exp, x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return self._elementwise(torch.sigmoid, x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return self._elementwise(F.silu, x)

    def softplus(self, x: torch.Tensor) -> torch.Tensor:
        return self._elementwise(F.softplus, x)

    def softmax(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self._elementwise(lambda t: t.softmax(dim=dim), x)

    def _elementwise(self, fn, x: torch.Tensor) -> torch.Tensor:
        return fn(x.double()).to(x.dtype) if self.invariant else fn(x)

    def head_sum(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Σ over `dim`. Invariant kernels sum fp32 over a contiguous copy with `dim` innermost, so an
        output's bits do not depend on the sizes of the other dims (docs/NUMERICS.md N8)."""
        if self.invariant and x.dtype == torch.float32:
            return x.movedim(dim, -1).contiguous().sum(-1)
        return x.sum(dim=dim)

    # ------------------------------------------------------------------------------ products
    def stream_mix(self, comb: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """fp32 Σ_i comb[..., i, j] · R_i (hc_post's residual mix, §7): comb [..., S, S], residual
        [..., S, D] → [..., S, D]. Reference numerics and invariant kernels sum over i as a plain
        reduction, which rounds as the reference does; fast BLAS kernels take one batched matmul, whose
        backward is a matmul too (the reduction's backward multiplies by a stride-0 view, ~40× slower on
        the CPU in training)."""
        if self.reference_order:
            return (comb.unsqueeze(-1) * residual.float().unsqueeze(-2)).sum(dim=-3)
        return torch.matmul(comb.transpose(-1, -2), residual.float())

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ weight [N, K]ᵀ in x's dtype (fp32 or bf16 operands of one dtype)."""
        if self._native_product(x, weight):
            out = native.linear(x, weight, exact=self.invariant)
            if out is not None:
                return out
        if not self.invariant:
            return F.linear(x, weight)
        rows = max(1, FLOAT64_CHUNK_ELEMENTS // max(weight.shape[1], 1))
        x64 = x.double()
        if rows >= weight.shape[0]:
            return _round(F.linear(x64, weight.double()), x.dtype)
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32, device=x.device)
        for i in range(0, weight.shape[0], rows):
            out[..., i:i + rows] = F.linear(x64, weight[i:i + rows].double())      # the one rounding, to fp32
        return out.to(x.dtype)

    def widened_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`linear` of x and weight both widened to fp32 (the router's scores, as the reference computes
        them). The native product widens a bf16 weight as it reads it, with `linear`'s bits (the widening
        is exact), instead of an fp32 copy of the weight per call (4 MB a layer at the released size)."""
        x = x.float()
        if self._native_product(x, weight, widening=True):
            out = native.linear(x, weight, exact=self.invariant)
            if out is not None:
                return out
        return self.linear(x, weight.float())

    def head_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What the output head holds its weight in: fp32 as the reference holds it (reference/blas
        reproduces its fp32 GEMM; trap 20), except for fast bf16 with the native kernels, which keeps the
        checkpoint's bf16 and widens it exactly as the native product reads it (`head_logits`): half the
        head's bytes in memory and in every decode step. Elsewhere a bf16 head would be widened by
        torch, a copy per call: more traffic than the fp32 weight."""
        return torch.bfloat16 if self.native and not self.quantized and dtype == torch.bfloat16 else torch.float32

    def head_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 logits of x [..., D] against the head's weight [V, D], fp32 or bf16 (then widened, exactly:
        natively as it is read for a few rows, else HEAD_WIDEN_ROWS vocabulary rows at a time, so no fp32
        copy of the whole head is made per call). Fast numerics' bf16 rows past NATIVE_GEMV_ROWS on a CPU
        with AMX tiles multiply there instead, bf16 by bf16 into fp32 sums (the products exact, as
        widened; the sums the tiles' order, as the layers' products past those rows; N39): the fp32
        product of 16 rows ran at a fifth of the multiply-adds the machine has."""
        if (x.dtype == weight.dtype == torch.bfloat16 and not self.invariant
                and x.numel() > NATIVE_GEMV_ROWS * x.shape[-1] and self._native_product(x, weight)
                and native.amx_products()):
            out = native.linear(x, weight, out_dtype=torch.float32)
            if out is not None:
                return out
        x = x.float()
        if weight.dtype == torch.float32:
            return self.linear(x, weight)
        if self._native_product(x, weight, widening=True):
            out = native.linear(x, weight, exact=self.invariant)
            if out is not None:
                return out
        return torch.cat([self.linear(x, weight[i:i + HEAD_WIDEN_ROWS].float())
                          for i in range(0, weight.shape[0], HEAD_WIDEN_ROWS)], dim=-1)

    def matmul_into(self, x: torch.Tensor, weight_t: torch.Tensor, out: torch.Tensor) -> None:
        """`linear` of x [m, K] with a transposed weight [K, N], written into out [m, N] (rows of a larger
        result): BLAS kernels write in place, without a temporary and a copy."""
        if self.invariant:
            out.copy_(self.linear(x, weight_t.t()))
        elif not (self._native_product(x, weight_t) and native.gemv(x, weight_t.t(), out, exact=False)):
            torch.mm(x, weight_t, out=out)

    def einsum(self, equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """A two-operand einsum in a's dtype (the attention and index-score products, wo_a's fallback)."""
        if not self.invariant:
            return torch.einsum(equation, a, b.to(a.dtype))
        return _round(torch.einsum(equation, a.double(), b.double()), a.dtype)

    def attention_scores(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, Dh] · kv [B, T, n, Dh] → fp32 [B, T, H, n] (a block's logits, attention.py): under
        invariant kernels the native exact product, 8 heads at a time per position (the bits of the
        float64 einsum without its float64 copies, docs/NUMERICS.md N13, N14)."""
        if self._native_attention(q, kv):
            B, T, H, Dh = q.shape
            out = q.new_empty(B, T, H, kv.shape[2])
            if native.gemv(q.reshape(B * T, H, Dh), kv.reshape(B * T, -1, Dh), out.view(B * T, H, -1), exact=True):
                return out
        return self.einsum("bthd,btnd->bthn", q, kv)

    def attention_values(self, p: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """p [B, T, H, n] · kv [B, T, n, Dh] → fp32 [B, T, H, Dh] (a block's P·V), as `attention_scores`."""
        if self._native_attention(p, kv):
            B, T, H, n = p.shape
            out = native.exact_kn(p.reshape(B * T, H, n), kv.reshape(B * T, n, -1))       # kv K-major
            if out is not None:
                return out.view(B, T, H, -1)
        return self.einsum("bthn,btnd->bthd", p, kv)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """layers.py's RMSNorm in one native call for fast numerics' decode rows (at most
        `NATIVE_POSITIONS` of them, no autograd; docs/NUMERICS.md N18). None where the policy leaves it to
        torch: reference numerics keep torch's mean, whose summation order the kernel does not reproduce."""
        if not (self.native and not self.invariant and x.is_cpu
                and x.numel() <= NATIVE_POSITIONS * x.shape[-1]):
            return None
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return None
        return native.rms_norm(x, weight, eps)

    def sparse_attention(self, q: torch.Tensor, pool: torch.Tensor | list[torch.Tensor], rows: torch.Tensor,
                         sink: torch.Tensor, scale: float, floor: float, picked: tuple | None = None) -> torch.Tensor | None:
        """attention.py's `sparse_attention` in one native call where the policy has no attention blocks
        (fast numerics) and the call is a decode step's (at most `NATIVE_POSITIONS` query positions, no
        autograd); None where it leaves it to attention.py (docs/NUMERICS.md N17). The pool may be the
        list of its parts and `picked` rows of a cache after them (`native.sparse_attention`, N40)."""
        if not (self.native and self.attention_block is None and q.is_cpu
                and q.shape[0] * q.shape[1] <= NATIVE_POSITIONS):
            return None
        parts = [pool] if torch.is_tensor(pool) else pool
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, *parts, sink, *(picked or ())[:1])):
            return None
        return native.sparse_attention(q, pool, rows, sink, scale, floor, picked)

    def gather_compressed(self, kv: torch.Tensor, token_slot: torch.Tensor, selected: torch.Tensor) -> torch.Tensor | None:
        """attention.py `Picked.rows`: the selected compressed rows copied out of their cache in one
        native call (an exact copy: any numerics; for an attention that does not read them there), for a
        decode step's few tokens (at most `NATIVE_POSITIONS`) outside autograd; None where the policy
        leaves it to attention.py."""
        if not (self.native and kv.is_cpu and selected.shape[0] <= NATIVE_POSITIONS):
            return None
        if torch.is_grad_enabled() and kv.requires_grad:
            return None
        return native.gather_compressed(kv, token_slot, selected)

    def engram_rows(self, weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, first: int) -> torch.Tensor | None:
        """engram/table.py's lookup of a host table into host memory in one native call (the rows'
        gather, decode, scale and bf16 cast: exact, so any numerics); None where the policy leaves it to
        the table's torch path."""
        if not (self.native and weight.is_cpu and ids.is_cpu):
            return None
        return native.engram_rows(weight, scale, ids, first)

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """indexer.py's scores of a key tile [B, T, c] in one native call where fast numerics run a
        decode step's (at most `NATIVE_POSITIONS` query positions, no autograd): every batch row at once,
        each score summed alone, so a row's scores do not depend on the batch (docs/NUMERICS.md N19).
        None where it leaves them to the indexer's torch path."""
        if not (self.native and not self.invariant and q.is_cpu
                and q.shape[0] * q.shape[1] <= NATIVE_POSITIONS):
            return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, weights, keys)):
            return None
        return native.index_scores(q, weights, keys)

    def _native_attention(self, a: torch.Tensor, kv: torch.Tensor) -> bool:
        return (self.native and self.invariant and a.dtype == kv.dtype == torch.float32 and a.is_cpu
                and a.is_contiguous() and kv.is_contiguous()
                and not (torch.is_grad_enabled() and (a.requires_grad or kv.requires_grad)))

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [B, T, G, I] through group g's own weight [G, R, I] → [B, T, G, R] in x's dtype (wo_a, §11.8)."""
        if self._native_product(x, weight):
            flat = x.reshape(-1, *x.shape[-2:])                                   # [M, G, I]
            out = x.new_empty(flat.shape[0], weight.shape[0], weight.shape[1])    # [M, G, R]
            if native.gemv(flat.transpose(0, 1), weight, out.transpose(0, 1), exact=self.invariant):
                return out.view(*x.shape[:-1], weight.shape[1])
        return self.einsum("btgi,gri->btgr", x, weight)

    def routed_experts(self, x: torch.Tensor, ids: torch.Tensor | None, weights: torch.Tensor | None,
                       w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
                       into: torch.Tensor | None = None,
                       shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                       scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                       dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Fast numerics' native routed experts of a few tokens (moe.py `RoutedExperts`): fp32 [n, D]
        (added into `into` when given; ids None: every token on expert 0, `native.routed_experts`), or
        None where the policy leaves them to the layer's torch path. `shared` (the shared expert's held
        w1, w3, w2): its output added in the same call, where `dense_swiglu` would take it (x in the
        weights' dtype, few rows), else None: the layer adds it itself. `scales` (stored experts): the
        banks are fp4 bytes with these ue8m0 scales, computed as if held in `dtype`."""
        pairs = x.shape[0] if ids is None else ids.numel()
        if not (self.native and not self.quantized and x.is_cpu and pairs <= NATIVE_EXPERT_PAIRS):
            return None
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weights, w1, w3, w2)):
            return None
        if shared is not None and not self._shared_rows(x, shared[0]):
            return None
        return native.routed_experts(x, ids, weights, w1, w3, w2, limit, into=into, shared=shared, scales=scales,
                                     dtype=dtype)

    def expert_matrix(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One stored fp4 expert matrix (int8 [out, in/2], ue8m0 [out, in/32]) dequantised to `dtype`:
        the values a held bank has (the loader's cast of formats.dequantize_fp4_weight), natively in one
        threaded pass where the library builds."""
        if self.native and weight.is_cpu:
            out = native.fp4_rows(weight, scale, dtype)
            if out is not None:
                return out
        return formats.dequantize_fp4_weight(weight, scale).to(dtype)

    def _shared_rows(self, x: torch.Tensor, w1: torch.Tensor) -> bool:
        """Whether the native kernel takes the shared expert of x's rows: few of them, in the weight's
        dtype; else the layer's torch products."""
        rows = x.shape[:-1].numel()
        return rows <= NATIVE_EXPERT_PAIRS and x.dtype == w1.dtype and not (w1.requires_grad and torch.is_grad_enabled())

    def route(self, logits: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float, eps: float,
              bias_vl: torch.Tensor | None, image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """moe.py `route` after the logits [n, E], fast numerics with BLAS kernels: one native call (the
        same scores, choice and weights as the torch path up to the last bit of √softplus; N21) instead
        of ~10 torch operations. None where the policy leaves it to the layer: reference numerics and
        exact-sum kernels keep torch's (double) softplus."""
        if not (self.native and not self.quantized and not self.invariant and logits.is_cpu):
            return None
        if torch.is_grad_enabled() and logits.requires_grad:
            return None
        return native.route(logits, bias, topk, route_scale, eps, bias_vl, image_mask)

    def dense_swiglu(self, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                     limit: float, into: torch.Tensor | None = None) -> torch.Tensor | None:
        """moe.py `Expert` (the shared expert, held weights) of a few rows in x's dtype: one native
        routed-experts call, every row on expert 0 at weight 1, which rounds where the layer does (the
        projections, the hidden and the output to the weights' dtype) instead of ~14 torch operations.
        `into` (fp32, x's rows): the rounded output is added to it in the call, in place (the layer's
        `into + out.float()`, the same bits), and returned. None where the policy leaves it to the layer."""
        if not self._shared_rows(x, w1):
            return None                                     # a prefill's many rows, or autograd
        rows = x.shape[:-1].numel()
        flat = x.reshape(rows, -1)                                                  # 2-d banks: one expert
        if into is not None:
            added = self.routed_experts(flat, None, None, w1, w3, w2, limit, into=into.view(rows, -1))
            return None if added is None else into
        out = self.routed_experts(flat, None, None, w1, w3, w2, limit)
        return None if out is None else out.to(x.dtype).view(*x.shape[:-1], -1)

    def split_mixes(self, m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, streams: int, iters: int,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The hyper-connection mixes of at most `NATIVE_MIX_ROWS` rows in one native call (hyper.py
        `split_mixes`; docs/NUMERICS.md N13): the bits of the reference-order torch path under
        invariant kernels, fast numerics' choice too. On CUDA with `triton`, any number of rows in one
        launch (N28). None where the policy leaves them to hyper.py."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in (m, scale, base)):
            return None
        # while torch.compile traces, the torch path is traced instead (as the native kernels decline, N22)
        if self.triton and m.is_cuda and not torch.compiler.is_compiling():
            return gpu_kernels.split_mixes(m, scale, base, streams, iters, eps)
        if not (self.native and m.is_cpu and m.shape[:-1].numel() <= NATIVE_MIX_ROWS):
            return None
        return native.split_mixes(m, scale, base, streams, iters, eps)

    def hc_mixes(self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
                 norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """hyper.py `mixes` (projection, RMS statistic and split) of at most `NATIVE_MIX_ROWS` rows in one
        native call, fast numerics only: its sums take the kernel's order (docs/NUMERICS.md N20), where
        reference numerics keep torch's mean. None where the policy leaves them to hyper.py."""
        if self.invariant or not self._native_mix(x, fn, scale, base):
            return None
        return native.hc_mixes(x, fn, scale, base, iters, norm_eps, hc_eps)

    def hc_collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor | None:
        """hyper.py `collapse` (hc_pre) of at most `NATIVE_MIX_ROWS` rows in one native call, with its
        bits (docs/NUMERICS.md N13); None where the policy leaves it to hyper.py."""
        if not self._native_mix(x, pre):
            return None
        return native.hc_collapse(x, pre)

    def hc_expand(self, out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor | None:
        """hyper.py `expand` (hc_post) likewise: the reference order's bits, fast numerics' choice too."""
        if not self._native_mix(residual, out, post, comb):
            return None
        return native.hc_expand(out, residual, post, comb)

    def hc_enter(self, x: torch.Tensor, pre: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 iters: int, norm_eps: float, hc_eps: float, norm_weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, post: torch.Tensor | None = None, comb: torch.Tensor | None = None):
        """block.py `Block._enter` (`hc_expand` of `out` when given, then `hc_mixes` and `rms_norm` of
        `hc_collapse`) in one native call where the policy would take each of the four natively: the
        same bits. None where it leaves any of them to torch; then the block makes them one by one."""
        if self.invariant or not self._native_mix(x, pre, fn, scale, base, *(() if out is None else (out, post, comb))):
            return None
        if x.shape[:-2].numel() > NATIVE_POSITIONS or torch.is_grad_enabled() and norm_weight.requires_grad:
            return None
        return native.hc_enter(x, pre, fn, scale, base, iters, norm_eps, hc_eps, norm_weight, eps, out, post, comb)

    def _native_projections(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """Whether a decode step's attention projections may run as one native call (`attention_in`,
        `attention_out`): where the policy would take each of their products, norms and rotations
        natively (fast numerics, bf16, few enough rows, no autograd), so the fused call has their bits."""
        if not (self.native and not self.quantized and x.is_cpu and x.dtype == torch.bfloat16):
            return False
        if x.shape[:2].numel() > min(NATIVE_POSITIONS, self._fast_product_rows(True)):      # [1, N, …]
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights)))

    def attention_in(self, x: torch.Tensor, wq_a: torch.Tensor, q_norm: tuple[torch.Tensor, float], wq_b: torch.Tensor,
                     wkv: torch.Tensor, kv_norm: tuple[torch.Tensor, float], phases: torch.Tensor, heads: int):
        """attention.py's query path (wq_a, q_norm, wq_b, RoPE) and key path (wkv, kv_norm, RoPE) of a decode
        step, x [1, N, D] → (qr, q [1, N, H, Dh], kv), in one native call with the bits of the calls one by
        one (docs/NUMERICS.md N33); None where the policy would leave any of them to torch."""
        if not self._native_projections(x, wq_a, wq_b, wkv, q_norm[0], kv_norm[0]):
            return None
        return native.attention_in(x, wq_a, q_norm[0], q_norm[1], wq_b, wkv, kv_norm[0], kv_norm[1], phases, heads)

    def attention_out(self, o: torch.Tensor, phases: torch.Tensor, wo_a: torch.Tensor, groups: int, wo_b: torch.Tensor):
        """attention.py's inverse RoPE, wo_a's groups (wo_a [G·Or, H·Dh/G], G = `groups`) and wo_b of a decode
        step, o [1, N, H, Dh] → [1, N, D] (this rank's partial product), in one native call with their bits
        (N33); None as above."""
        if not self._native_projections(o, wo_a, wo_b):
            return None
        return native.attention_out(o, phases, wo_a.unflatten(0, (groups, -1)), wo_b)

    def publish(self, tokens: torch.Tensor | None, compressor: tuple[torch.Tensor, torch.Tensor, float] | None,
                latent: torch.Tensor | None, indexer: tuple[torch.Tensor, torch.Tensor, float], phases: torch.Tensor,
                kv: torch.Tensor, index_keys: torch.Tensor, slots: list[int], rows: list[int]) -> bool:
        """attention.py `Attention._publish` of a decode step's new compressed rows in one native call
        (N34): from the latents [G, Dh] pre-RoPE, or from the tokens [G, D] of an r = 1 source with its
        compressor's (wkv, norm weight, eps), the RoPE'd rows and their index keys (the indexer's (wk,
        k_norm weight, eps)) written as row rows[i] of slot slots[i] of the cache's kv and index_keys.
        False where the policy would leave any part to torch (nothing written then)."""
        source = latent if tokens is None else tokens
        weights = (indexer[0], indexer[1], *(compressor[:2] if compressor else ()))
        if not self._native_projections(source[None], *weights) or not _cache_rows(kv, index_keys, slots, rows):
            return False
        wkv, norm, eps = compressor or (None, None, 0.0)
        return native.publish(tokens, wkv, norm, eps, latent, *indexer, phases, kv, index_keys, slots, rows)

    def index_select(self, x: torch.Tensor, qr: torch.Tensor, indexer: tuple[torch.Tensor, torch.Tensor, float],
                     phases: torch.Tensor, keys: list[tuple[torch.Tensor, int]], C: int, visible: torch.Tensor,
                     topk: int, blocks: tuple[int, int] | None, restrict: torch.Tensor | None):
        """attention.py `Attention.select` of a decode step's tokens x [1, N, D] (one per row), qr [1, N, Qr],
        in one native call (N34): the indexer's queries (its (wq_b, weights_proj, weight scale)), each
        token's scores against its row's keys (`keys`: per token the cache's index_keys and the slot),
        the candidate stage (`blocks`) or restriction, the top-k → (chosen [N, k], kept-block mask [N, C]
        or None), the bits of the calls one by one. None where the policy would leave a part to torch."""
        if not self._native_projections(x, qr, indexer[0], indexer[1]):
            return None
        if any(t.dtype != torch.bfloat16 or t.shape[1] < C or t.stride(2) != 1 or not 0 <= s < t.shape[0] for t, s in keys):
            return None
        return native.index_select(x, qr, *indexer, phases, keys, C, visible, topk, blocks, restrict)

    def moe(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float, eps: float,
            limit: float, banks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
            shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
            scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """moe.py `MoE.routed` of a decode step's tokens x [n, D] (bf16) in one native call (N33): the gate's
        widened logits, the router, the routed experts and the shared one, → (output [n, D] bf16, ids
        [n, topk]), the bits of `widened_linear`, `route` and `routed_experts` one by one. None where the
        policy would leave any of them to torch (then the layer makes them one by one)."""
        if not self._native_moe(x, gate, topk, banks, shared):
            return None
        return native.moe(x, gate, bias, topk, route_scale, eps, limit, banks, shared, scales)

    def _native_moe(self, x: torch.Tensor, gate: torch.Tensor, topk: int, banks: tuple[torch.Tensor, ...],
                    shared: tuple[torch.Tensor, ...]) -> bool:
        """Whether `moe` may take x [..., D]: where the policy takes the gate, the router and the experts natively."""
        if not (self.native and not self.quantized and x.is_cpu and x.dtype == torch.bfloat16):
            return False
        rows = x.shape[:-1].numel()
        if rows * topk > NATIVE_EXPERT_PAIRS or rows > self._fast_product_rows(False) or not self._shared_rows(x, shared[0]):
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate, *banks)))

    def attention_entry(self, x: torch.Tensor, pre: torch.Tensor, mixes: tuple, norm: tuple[torch.Tensor, float],
                        projections: tuple):
        """block.py's way into a decode step's attention in one native call (N35): the attention's entry
        (`hc_enter` of the streams x [1, N, S, D] without a previous output) and its query and key paths
        (`attention_in`'s arguments after its rows: `Attention.projections`) → ((pre, post, comb), h
        [1, N, D], (qr, q, kv)), the bits of the two calls. None where the policy would leave either to
        its own calls."""
        if self.invariant or x.dim() != 4 or x.shape[0] != 1 or not self._native_mix(x, pre, *mixes[:3]):
            return None
        if x.shape[1] > min(NATIVE_POSITIONS, self._fast_product_rows(True)) or x.dtype != torch.bfloat16:
            return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in (norm[0], *projections[:2], *projections[3:6])):
            return None
        return native.attention_entry(x, pre, mixes, norm, projections)

    def ffn_half(self, x: torch.Tensor, pre: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 mixes: tuple, norm: tuple[torch.Tensor, float], moe: tuple):
        """block.py's feed-forward half of a decode step in one native call (N35): the FFN's entry (`hc_enter`
        of the streams x [1, N, S, D] with the attention's output out [1, N, D]), its MoE (`moe`'s
        arguments after x: `MoE.fused_parts`) and the expansion of its output → (streams, the FFN's pre
        [1, N, S], the chosen ids [N, k]), the bits of the three calls. None where the policy would leave
        any of them to their own calls. mixes: (fn, scale, base, iters, norm eps, hc eps); norm: (weight, eps)."""
        if self.invariant or x.dim() != 4 or x.shape[0] != 1 or not self._native_mix(x, pre, *mixes[:3], out, post, comb):
            return None
        if x.shape[1] > NATIVE_POSITIONS or torch.is_grad_enabled() and norm[0].requires_grad:
            return None
        gate, _, topk, _, _, _, banks, shared, _ = moe
        if not self._native_moe(out, gate, topk, banks, shared):
            return None
        return native.ffn_half(x, pre, out, post, comb, mixes, norm, *moe)

    def rope(self, x: torch.Tensor, phases: torch.Tensor, inverse: bool = False) -> torch.Tensor | None:
        """rope.py `Rotary.rotate` of at most `NATIVE_POSITIONS` positions in one native call, with its
        bits (docs/NUMERICS.md N13): phases complex64 [B or 1, T, R/2] (the kernel conjugates them for
        the inverse); None where the policy leaves it to rope.py."""
        if not (self.native and x.is_cpu and x.shape[:2].numel() <= NATIVE_POSITIONS):
            return None
        if torch.is_grad_enabled() and x.requires_grad:
            return None
        return native.rope(x, phases, inverse)

    def topk(self, scores: torch.Tensor, k: int, *, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """topk.py's `topk` (exact ties to the lower index): one native call on the CPU where the policy
        has the library (no arithmetic, so the same set and order under every policy; N15)."""
        if self.native and scores.is_cpu and not (torch.is_grad_enabled() and scores.requires_grad):
            out = native.topk(scores, k, sorted)
            if out is not None:
                return out
        return ordered_topk(scores, k, sorted=sorted)

    def _native_mix(self, x: torch.Tensor, *others: torch.Tensor) -> bool:
        """x [..., S, D]: few rows on the CPU, at most 4 streams, no autograd recording."""
        if not (self.native and x.is_cpu and x.shape[-2] <= 4
                and x.shape[:-2].numel() <= NATIVE_MIX_ROWS):
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)))

    def _native_product(self, x: torch.Tensor, weight: torch.Tensor, *, widening: bool = False) -> bool:
        """Whether the native dense product takes x (rows of the last dim) against `weight`: few rows, on
        the CPU, operands of one dtype, and no autograd to record (the kernel has no backward). Fast
        numerics take it for bf16 weights and for fp32 ones of at least `NATIVE_FP32_FROM` values
        (MKL's fp32 GEMV is as fast below); invariant kernels for bf16 and fp32, with exact products
        summed in double (`native.gemv(exact=True)`). `widening`: fp32 rows against a bf16 weight the
        kernel widens as it reads it (the alternative is an fp32 copy of the weight, then the product)."""
        mixed = widening and x.dtype == torch.float32 and weight.dtype == torch.bfloat16
        if not self.native or (weight.dtype != x.dtype and not mixed) or not x.is_cpu:
            return False
        if x.dtype == torch.float32:
            if not (self.invariant or mixed or weight.numel() >= NATIVE_FP32_FROM):
                return False
        elif x.dtype != torch.bfloat16:
            return False
        rows = NATIVE_GEMV_ROWS if self.invariant else self._fast_product_rows(x.dtype == torch.bfloat16)
        if x.numel() > rows * x.shape[-1] * (weight.shape[0] if weight.dim() == 3 else 1):
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))

    @staticmethod
    def _fast_product_rows(bf16: bool) -> int:
        """Most rows per weight of fast numerics' native product: `NATIVE_WIDE_ROWS` where the build
        multiplies in wide tiles (bf16 past a few rows on AMX tiles where it has them, N37),
        `NATIVE_GEMV_ROWS` without."""
        return NATIVE_WIDE_ROWS if native.wide_products(bf16) else NATIVE_GEMV_ROWS

    def activation_einsum(self, equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """`einsum` of two activations (no weight), which the CPU kernels compute from fp32 copies."""
        if self.cpu_kernels and a.dtype == torch.bfloat16:
            return torch.einsum(equation, a.float(), b.float()).to(a.dtype)
        return self.einsum(equation, a, b)

    def block_operand_dtype(self, storage: str) -> torch.dtype:
        """The precision a quantised GEMM takes a weight's code values in: float64 for fp8 weights under
        invariant kernels (their block sums are exact only there), float32 otherwise (fp4 blocks are
        made exact in float32 by `block_scaled_matmul`)."""
        return torch.float64 if self.invariant and storage == "fp8" else torch.float32

    def block_scaled_matmul(self, q: torch.Tensor, q_scale: torch.Tensor, stored: torch.Tensor,
                            w_scale: torch.Tensor, storage: str) -> torch.Tensor:
        """The reference's quantised GEMM (§6.3): fp32 [M, N].

        q [M, K] e4m3 activations, q_scale [M, nb]; stored [N, K] e4m3 bytes ("fp8") or [N, K/2] packed
        e2m1 ("fp4") of the weight, unscaled; w_scale [N, nb] fp32 per output row. Invariant kernels
        also take a leading pair dim P on all four ([P, M, K] … → [P, M, N]): one weight per pair.
        Each 32-wide K block is summed on its own, the partial sum scaled by both (power-of-two) scales
        and added to an fp32 accumulator in K order. BLAS kernels decode the weight and run one fp32
        product per block, at the reference's shapes. Invariant kernels sum a block exactly, then round
        it once, so the blocks' sums can come from one batched product (any order gives the same bits)
        and only the fp32 accumulation stays sequential:
        - e4m3 × e4m3 in float64: a product has at most 8 significant bits and a block spans fewer than
          2⁴¹ of its units;
        - e4m3 × e2m1 in float32, the activations split into integer and fraction parts
          (a = trunc(a) + frac): |trunc(a)| ≤ 448 and w is a multiple of 1/2 up to 6, so trunc(a)·w
          counts fewer than 2¹³ halves and a block of 32 fewer than 2¹⁸; frac·w counts fewer than 2¹³
          units of 2⁻¹⁰ likewise. Every partial sum fits float32's 24 bits, in any order and with FMA;
          one fp32 addition of the two halves then rounds their exact sum once. This reads 4 bytes per
          weight instead of 8.
        Invariant kernels decode the weight's code values piece by piece, each piece right before its
        product (`DECODE_CHUNK_ELEMENTS`), never the whole weight at once.
        """
        M, K = q.shape[-2:]
        nb, N, lead = K // GEMM_BLOCK, stored.shape[-2], q.shape[:-2]
        if self.native and q.is_cpu:
            out = native.block_gemm(q.reshape(-1, M, K), q_scale.reshape(-1, M, nb),
                                    stored.reshape(-1, N, stored.shape[-1]), w_scale.reshape(-1, N, nb), storage)
            if out is not None:
                return out.view(*lead, M, N)
        fmt, dtype = ("e2m1x2" if storage == "fp4" else "e4m3"), self.block_operand_dtype(storage)
        # activations are small: torch's exact widening cast is one op, the table lookup several
        a = q.to(dtype) if q.numel() < CAST_BELOW else formats.decode_bytes(q, "e4m3", dtype)
        acc = torch.zeros(*q.shape[:-1], N, dtype=torch.float32, device=q.device)
        if not self.invariant:
            w = formats.decode_bytes(stored, fmt, dtype)
            for k in range(nb):
                cols = slice(k * GEMM_BLOCK, (k + 1) * GEMM_BLOCK)
                acc += torch.mm(a[:, cols], w[:, cols].t()) * q_scale[:, k:k + 1] * w_scale[:, k].unsqueeze(0)
            return acc
        split = storage == "fp4"
        if split:
            whole = a.trunc()
            a = torch.cat([whole, a - whole], dim=-2)                              # [..., 2M, K], both exact
        rows = a.shape[-2]
        a_blocks = a.view(*lead, rows, nb, GEMM_BLOCK)                             # [..., rows, nb, 32]
        per_byte = K // stored.shape[-1]                                           # values per stored byte
        k_step = max(1, BLOCK_PARTIALS_ELEMENTS // max(a.shape[:-1].numel() * N, 1))
        for k0 in range(0, nb, k_step):
            k1 = min(nb, k0 + k_step)
            width = (k1 - k0) * GEMM_BLOCK
            n_step = max(1, DECODE_CHUNK_ELEMENTS // max(lead.numel() * width, 1))
            pieces = []
            for n0 in range(0, N, n_step):
                n1 = min(N, n0 + n_step)
                piece = stored[..., n0:n1, k0 * GEMM_BLOCK // per_byte:k1 * GEMM_BLOCK // per_byte]
                w_blocks = formats.decode_bytes(piece, fmt, dtype).view(*lead, n1 - n0, k1 - k0, GEMM_BLOCK)
                pieces.append(_exact_block_sums(a_blocks[..., k0:k1, :], w_blocks, M, split))
            partial = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
            partial.mul_(q_scale[..., k0:k1].transpose(-1, -2).unsqueeze(-1))
            partial.mul_(w_scale[..., k0:k1].transpose(-1, -2).unsqueeze(-2))
            for block in partial.unbind(-3):
                acc += block
        return acc

    def pairs_at_once(self, storage: str) -> bool:
        """Whether routed experts stored as `storage` may run their (token, expert) pairs as one batched
        product per projection: with exact block sums a pair's bits do not depend on which rows share
        its call (docs/NUMERICS.md N7, N9)."""
        return self.quantized and self.invariant and storage in ("fp8", "fp4")


def _exact_block_sums(a: torch.Tensor, w: torch.Tensor, M: int, split: bool) -> torch.Tensor:
    """Σ over each 32-wide block of a [..., rows, k, 32] × w [..., n, k, 32] → fp32 [..., k, M, n], each
    exact sum rounded once: rows are M activation rows (float64 products), or their M integer parts then
    M fractions (fp32 products, the two exact halves added once). A single row takes a product and a
    sum per block, reading w in place: a matmul would first copy w into [k, 32, n], a transposition
    that cost more than the product itself (6 × 512 × 512 fp4 expert weights: 2.3 of 2.7 ms)."""
    if M == 1:
        sums = [(w * a[..., r:r + 1, :, :]).sum(-1) for r in range(a.shape[-3])]   # [..., n, k] each
        block = sums[0] + sums[1] if split else sums[0].float()
        return block.transpose(-1, -2).unsqueeze(-2)
    exact = torch.matmul(a.transpose(-3, -2), w.movedim(-3, -1))                  # [..., k, rows, n]
    return exact[..., :M, :] + exact[..., M:, :] if split else exact.float()


def _round(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 → fp32 (one rounding) → dtype: bf16 results round from fp32, as an fp32 accumulator's do."""
    return x64.float().to(dtype)


REFERENCE = Numerics("reference", "invariant")
FAST = Numerics("fast", "blas")


def _cache_rows(kv: torch.Tensor, index_keys: torch.Tensor, slots: list[int], rows: list[int]) -> bool:
    """Whether a native kernel may write row rows[i] of slot slots[i] of both bf16 cache tensors: every
    pair inside them (an indexed write out of range raises; a pointer would write past the tensor)."""
    if kv.dtype != torch.bfloat16 or index_keys.dtype != torch.bfloat16 or kv.stride(2) != 1 or index_keys.stride(2) != 1:
        return False
    n_slots, length = min(kv.shape[0], index_keys.shape[0]), min(kv.shape[1], index_keys.shape[1])
    return all(0 <= s < n_slots and 0 <= r < length for s, r in zip(slots, rows))
