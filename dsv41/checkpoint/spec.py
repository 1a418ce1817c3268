"""What one stored tensor is (name, safetensors dtype, shape), and the safetensors dtype table.

The dtype strings are the ones safetensors headers use (docs/CHECKPOINT.md §2). `I8` in this checkpoint holds
packed fp4 e2m1 (two values per byte); it is read back as int8 and unpacked by `dsv41.model.formats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

# safetensors dtype string -> (torch dtype, bytes per element).
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
}
TORCH_TO_DTYPE: dict[torch.dtype, str] = {t: name for name, (t, _) in DTYPES.items()}


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][1]


def torch_dtype(dtype: str) -> torch.dtype:
    return DTYPES[dtype][0]


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_DTYPE[dtype]
    except KeyError:
        raise CheckpointError(f"{dtype} has no safetensors dtype (supported: {', '.join(DTYPES)})") from None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CheckpointError(f"{self.name}: unknown safetensors dtype {self.dtype!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def describe(self) -> str:
        return f"{self.dtype} [{', '.join(map(str, self.shape))}]"
