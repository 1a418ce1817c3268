"""A byte-counting progress bar that stays silent unless stderr is a terminal (logs and CI stay clean)."""

from __future__ import annotations

import sys

from tqdm import tqdm


def byte_progress(total_bytes: int | None, description: str, *, enabled: bool | None = None) -> tqdm:
    """Use as a context manager and call `.update(n_bytes)`; `enabled=None` means "if stderr is a tty"."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, file=sys.stderr, leave=False)
