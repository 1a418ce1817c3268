"""Number-format codecs, block quantisation and quantise-dequantise (QDQ) helpers.

Formats are those of docs/ARCHITECTURE.md §6.1 and docs/CHECKPOINT.md §2: e4m3 (`float8_e4m3fn`), ue8m0
(`float8_e8m0fnu`, value 2^(byte-127), 0xFF = NaN), e2m1 (fp4, sign in bit 3) and packed fp4 (low
nibble = even element). Weight layouts follow §6.2, activation quantisation §6.3, the attention QDQ
points #2-#4 §6.4. All arithmetic is fp32; every function is pure and works on any device and any
leading dims.

Power-of-two scales are built from the fp32 bit pattern, never through torch's float -> e8m0 cast:
that cast rounds to the nearest power (1.5 -> 2, 3 -> 4), drops the sign and maps 0 to 2^-127.
"""

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite e4m3fn value (§6.1)
FP4_MAX = 6.0  # largest e2m1 value (§6.1)
FP8_WEIGHT_BLOCK = 32  # dense fp8 weights use 32x32 blocks, not V3's 128 (§6.2, trap 4)
FP4_WEIGHT_BLOCK = 32  # fp4 expert scales cover 1x32 blocks along the input (§6.2)
ENGRAM_BLOCK = 32  # Engram table scales cover 1x32 blocks along the row (§6.2)

# §6.3 / §6.4: the activation scales multiply by the fp32-rounded reciprocal, not divide. A Python
# float holding an fp32 value gives the same product as an fp32 multiply (the exact product of two
# fp32 numbers fits a double, then rounds once).
INV_FP8_MAX_F32 = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
INV_FP4_MAX_F32 = float(torch.tensor(1.0 / FP4_MAX, dtype=torch.float32))
ACT_AMAX_FLOOR = 1e-4  # fp8 activation / window-KV amax floor (§6.3, §6.4 point #2)
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # point #3: keeps the e4m3 scale >= its smallest subnormal
FP4_E8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # point #4: keeps the ue8m0 scale a normal fp32 number

# Value of each 4-bit e2m1 code (§6.1); codes 8..15 are the negatives (8 is -0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << 23) - 1
_F32_ABS_MASK = 0x7FFFFFFF
_E8M0_NAN = 255


# ---------------------------------------------------------------- ue8m0 -------------------------


def e8m0_to_float(scale: Tensor) -> Tensor:
    """ue8m0 (or its raw uint8 bytes) -> fp32 2^(byte-127); byte 255 -> NaN. Exact, including byte 0."""
    # torch's own widening cast is exact for every byte (0 → 2^-127, 255 → NaN; tested per byte)
    return scale.view(torch.float8_e8m0fnu).to(torch.float32)


def float_to_e8m0(pow2: Tensor) -> Tensor:
    """Exact fp32 powers of two -> float8_e8m0fnu. The byte is the fp32 exponent field (mantissa bits
    are ignored, so callers must pass powers of two); 2^-127 (a subnormal) -> 0; NaN/inf -> 255."""
    bits = pow2.to(torch.float32).contiguous().view(torch.int32) & _F32_ABS_MASK
    byte = bits >> _F32_MANTISSA_BITS  # 0 for zero and subnormals, 255 for inf/NaN
    return byte.to(torch.uint8).view(torch.float8_e8m0fnu)


def pow2_ceil(x: Tensor) -> Tensor:
    """fp32 2^ceil(log2 x) for positive fp32 x, from the bits: exponent, plus one if the mantissa is
    non-zero (§6.3). As that rule reads, subnormal x give 2^-126 (an upper bound, not the tight
    power), zero gives 2^-127, and x > 2^127 gives NaN (no fp32/ue8m0 power above it)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32) & _F32_ABS_MASK
    exponent = bits >> _F32_MANTISSA_BITS
    exponent = exponent + ((bits & _F32_MANTISSA_MASK) != 0).to(torch.int32)
    return e8m0_to_float(exponent.clamp(max=_E8M0_NAN).to(torch.uint8))


def _scale_as_float(scale: Tensor) -> Tensor:
    # Checkpoint scales are ue8m0; also accept raw bytes or scales already held as floats.
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float(scale)
    return scale.to(torch.float32)


# ---------------------------------------------------------------- e2m1 (fp4) --------------------

# Midpoints between adjacent e2m1 magnitudes; at a midpoint the even code wins (§6.4), so a
# magnitude moves up past a midpoint whose upper neighbour has an even code (>=) and only strictly
# past one whose lower neighbour is even (>).
_E2M1_MIDPOINTS_UP_ON_TIE = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                             (2.5, False), (3.5, True), (5.0, False))


def fp4_encode(x: Tensor) -> Tensor:
    """float -> e2m1 code 0..15: round to nearest, ties to the even code, saturating at +-6; the sign
    (bit 3) is kept for zeros and for values that round to zero. NaN encodes as +-0."""
    xf = x.to(torch.float32)
    mag = xf.abs()
    code = torch.zeros(xf.shape, dtype=torch.uint8, device=xf.device)
    for midpoint, up_on_tie in _E2M1_MIDPOINTS_UP_ON_TIE:  # 7 vectorised steps, not per element
        code += (mag >= midpoint if up_on_tie else mag > midpoint).to(torch.uint8)
    return code | (torch.signbit(xf).to(torch.uint8) << 3)


def fp4_decode(codes: Tensor) -> Tensor:
    """e2m1 codes (any integer dtype, values 0..15) -> fp32."""
    return e2m1_table(codes.device)[codes.to(torch.long)]


def e2m1_table(device) -> Tensor:
    """`E2M1_VALUES` on `device`. Off the CPU it is computed there (magnitude codes 0, 1 are 0 and 1/2;
    code m ≥ 2 is 2^(m//2 − 1) · (1 + (m & 1)/2)) rather than copied from host memory: a copy per call
    is a host synchronisation on CUDA."""
    return E2M1_VALUES if torch.device(device).type == "cpu" else e2m1_computed(device)


def e2m1_computed(device) -> Tensor:
    code = torch.arange(16, device=device)
    magnitude = code & 7
    normal = torch.ldexp(1.0 + (magnitude & 1) * 0.5, (magnitude >> 1) - 1)
    value = torch.where(magnitude < 2, magnitude * 0.5, normal)
    return torch.where(code >= 8, -value, value)


def byte_values(fmt: str) -> Tensor:
    """fp32 [256]: the value of every byte of "e4m3" (torch's own exact widening cast, once per byte)
    or [256, 2] of a packed "e2m1x2" byte (its even element in the low nibble, then its odd one)."""
    raw = torch.arange(256, dtype=torch.int32)
    if fmt == "e4m3":
        return raw.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return torch.stack((E2M1_VALUES[raw & 0xF], E2M1_VALUES[raw >> 4]), dim=-1)


# Lookup tables of whole rows viewed as one integer (or complex) element of the same bytes, so a
# lookup is a plain row copy: (stored bytes per index, rows). A row of 4 bytes is as slow to copy as
# the fp8 cast, so fp32 e4m3 looks up two stored bytes at once (65,536 rows, index = even + 256 · odd,
# little-endian). Built once, read-only.
_ROW_AS_ELEMENT = {8: torch.int64, 16: torch.complex128}


def _lookup(values: Tensor, dtype: torch.dtype) -> Tensor:
    rows = values.to(dtype).reshape(values.shape[0], -1).contiguous()
    return rows.view(_ROW_AS_ELEMENT[rows.shape[1] * rows.element_size()]).reshape(-1)


_E4M3 = byte_values("e4m3")
_E4M3_PAIRS = torch.stack((_E4M3.repeat(256), _E4M3.repeat_interleave(256)), dim=-1)
_LOOKUPS = {("e4m3", torch.float32): (2, _lookup(_E4M3_PAIRS, torch.float32)),
            ("e4m3", torch.float64): (1, _lookup(_E4M3, torch.float64)),
            ("e2m1x2", torch.float32): (1, _lookup(byte_values("e2m1x2"), torch.float32)),
            ("e2m1x2", torch.float64): (1, _lookup(byte_values("e2m1x2"), torch.float64))}


def decode_bytes(stored: Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """Stored bytes [..., n] of `fmt` ("e4m3", or "e2m1x2" packed fp4) → their values in `dtype` (fp32
    or float64; [..., n], or [..., 2n] for packed fp4) by one table lookup per 1 or 2 stored bytes,
    several times faster on the CPU than torch's fp8 cast or an unpack-then-decode of fp4
    (`benchmarks/bench_formats.py`)."""
    if (fmt, dtype) not in _LOOKUPS:
        raise ValueError(f"unknown byte format {fmt!r} in {dtype}; expected 'e4m3' or 'e2m1x2' in fp32 or float64")
    if not stored.is_cpu:
        return _decode_on_device(stored, fmt, dtype)
    width, rows = _LOOKUPS[fmt, dtype]
    if stored.shape[-1] % width:
        return stored.view(torch.float8_e4m3fn).to(dtype)               # an odd row: e4m3 by the cast
    raw = stored.reshape(-1).view(torch.uint8)
    codes = raw.view(torch.int16).to(torch.int32) & 0xFFFF if width == 2 else raw.to(torch.int32)
    return rows.index_select(0, codes).view(dtype).view(*stored.shape[:-1], -1)


def _decode_on_device(stored: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    """`decode_bytes` where the bytes are not in host memory: torch's exact e4m3 cast, or both nibbles
    through `e2m1_table` (the host tables would be copied to the device at every call)."""
    if fmt == "e4m3":
        return stored.view(torch.float8_e4m3fn).to(dtype)
    raw = stored.view(torch.uint8).to(torch.long)
    table = e2m1_table(stored.device).to(dtype)
    return torch.stack((table[raw & 0xF], table[raw >> 4]), dim=-1).flatten(-2)


def pack_fp4(codes: Tensor) -> Tensor:
    """uint8 codes [..., n] -> int8 [..., n/2]; byte = even element + 16 * odd element (§6.1)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    packed = (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)
    return packed.view(torch.int8)


def unpack_fp4(packed: Tensor) -> Tensor:
    """int8/uint8 (or any 1-byte dtype) [..., n/2] -> uint8 codes [..., n]."""
    raw = packed.view(torch.uint8)
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)


def _e2m1_round(x: Tensor) -> Tensor:
    return fp4_decode(fp4_encode(x))


# ---------------------------------------------------------------- weights (§6.2) ----------------


def _expand_blocks_2d(scale: Tensor, block: int, rows: int, cols: int) -> Tensor:
    # [ceil(rows/b), ceil(cols/b)] -> [rows, cols], each scale covering its b x b tile.
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[:rows, :cols]


def quantize_fp8_weight(w: Tensor, block: int = FP8_WEIGHT_BLOCK) -> tuple[Tensor, Tensor]:
    """float [out, in] -> (e4m3 [out, in], ue8m0 [ceil(out/b), ceil(in/b)]); per b x b block the
    scale is pow2_ceil(max(amax, fp32 tiny) / 448)."""
    rows, cols = w.shape
    wf = w.to(torch.float32)
    pad_r, pad_c = -rows % block, -cols % block
    padded = torch.nn.functional.pad(wf, (0, pad_c, 0, pad_r))  # zeros never raise a block's amax
    blocks = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=torch.finfo(torch.float32).tiny)
    scale = pow2_ceil(amax / FP8_MAX)
    q = (wf / _expand_blocks_2d(scale, block, rows, cols)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), float_to_e8m0(scale)


def dequantize_fp8_weight(weight: Tensor, scale: Tensor, block: int = FP8_WEIGHT_BLOCK) -> Tensor:
    """e4m3 [out, in] with ue8m0 [ceil(out/b), ceil(in/b)] -> fp32; value = w[o,i] * scale[o//b, i//b]."""
    rows, cols = weight.shape
    return weight.to(torch.float32) * _expand_blocks_2d(_scale_as_float(scale), block, rows, cols)


def _scale_last_dim(values: Tensor, scale: Tensor, block: int) -> Tensor:
    # values fp32 [..., n], scale fp32 [..., n/block]: one scale per block of the last dim.
    blocks = values.unflatten(-1, (-1, block))
    return (blocks * scale.unsqueeze(-1)).flatten(-2)


def quantize_fp4_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """float [..., out, in] (in % 32 == 0) -> (packed int8 [..., out, in/2], ue8m0 [..., out, in/32]);
    per 1x32 block the scale is pow2_ceil(amax / 6)."""
    _check_blocks(w, FP4_WEIGHT_BLOCK)
    blocks = w.to(torch.float32).unflatten(-1, (-1, FP4_WEIGHT_BLOCK))
    scale = pow2_ceil(blocks.abs().amax(dim=-1) / FP4_MAX)
    codes = fp4_encode(blocks / scale.unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), float_to_e8m0(scale)


def dequantize_fp4_weight(packed: Tensor, scale: Tensor) -> Tensor:
    """packed e2m1 [..., out, in/2] with ue8m0 [..., out, in/32] -> fp32 [..., out, in]."""
    values = fp4_decode(unpack_fp4(packed))
    return _scale_last_dim(values, _scale_as_float(scale), FP4_WEIGHT_BLOCK)


def quantize_fp8_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Engram table rows float [..., n] -> (e4m3 [..., n], ue8m0 [..., n/32]); per 1x32 block the scale is
    pow2_ceil(max(amax, 1e-4) / 448), as the tables are written (docs/CHECKPOINT.md §2)."""
    _check_blocks(rows, ENGRAM_BLOCK)
    blocks = rows.to(torch.float32).unflatten(-1, (-1, ENGRAM_BLOCK))
    scale = pow2_ceil(blocks.abs().amax(dim=-1).clamp(min=1e-4) / FP8_MAX)
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).flatten(-2)
    return q.to(torch.float8_e4m3fn), float_to_e8m0(scale)


def dequantize_fp8_rows(weight: Tensor, scale: Tensor) -> Tensor:
    """Engram table rows: e4m3 [..., n] with ue8m0 [..., n/32] (1x32 blocks along the row) -> fp32."""
    return _scale_last_dim(decode_bytes(weight, "e4m3"), _scale_as_float(scale), ENGRAM_BLOCK)


# ---------------------------------------------------------------- activations (§6.3, §6.4) -----


def _check_blocks(x: Tensor, block: int) -> None:
    if x.shape[-1] % block:
        raise ValueError(f"last dim of {tuple(x.shape)} is not a multiple of the block {block}")


def _block_amax(x: Tensor, block: int, floor: float) -> tuple[Tensor, Tensor]:
    # -> (fp32 [..., n/block, block], amax fp32 [..., n/block] floored)
    _check_blocks(x, block)
    blocks = x.to(torch.float32).unflatten(-1, (-1, block))
    return blocks, blocks.abs().amax(dim=-1).clamp(min=floor)


def fp8_act_quant(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """§6.3 point #1: -> (e4m3 q, same shape as x; fp32 power-of-two scale [..., n/block])."""
    blocks, amax = _block_amax(x, block, ACT_AMAX_FLOOR)
    scale = pow2_ceil(amax * INV_FP8_MAX_F32)
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def fp8_qdq(x: Tensor, block: int = 32) -> Tensor:
    """fp8 QDQ (§6.4 point #2 and the activation path): e4m3_RNE(clamp(x/s, +-448)) * s, in x.dtype."""
    q, scale = fp8_act_quant(x, block)
    return _scale_last_dim(q.to(torch.float32), scale, block).to(x.dtype)


def _fp4_qdq(blocks: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    scaled = (blocks / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return (_e2m1_round(scaled) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def fp4_qdq_e4m3(x: Tensor, block: int = 16) -> Tensor:
    """§6.4 point #3 (compressed KV): scale = e4m3_RNE(amax/6), amax >= 6*2^-9; returns x.dtype."""
    blocks, amax = _block_amax(x, block, FP4_E4M3_AMAX_FLOOR)
    # Clamp before the cast so saturation does not depend on the backend's overflow behaviour.
    scale = (amax / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return _fp4_qdq(blocks, scale, x.dtype)


def fp4_qdq_e8m0(x: Tensor, block: int = 32) -> Tensor:
    """§6.4 point #4 (indexer q/k): scale = pow2_ceil(amax * fp32(1/6)), amax >= 6*2^-126; x.dtype."""
    blocks, amax = _block_amax(x, block, FP4_E8M0_AMAX_FLOOR)
    return _fp4_qdq(blocks, pow2_ceil(amax * INV_FP4_MAX_F32), x.dtype)
