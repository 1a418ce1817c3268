"""Image spans in a token sequence: expanding placeholders, token types, and the rows a call overwrites.

Shapes: L span length, D dim, M the image's LLM cells, n span positions in one call.

A prompt carries one `image_token_id` per image; `expand_images` replaces each by its span, whose every
position carries that same id (§16.1), so only the token types — and, for prefix reuse, the image digest
(`position_keys`) — tell two images apart. A span's rows (`span_rows`) are the learned delimiters and the
aligner's rows in reading order; a call that feeds any part of a span overwrites those positions'
embeddings with them (`SpanRows`), so a span can be split across prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ImageError
from .processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, ImageInput


@dataclass(frozen=True, eq=False)
class PromptImage:
    """An image span of a prompt: positions start … start + L − 1."""

    start: int
    image: ImageInput

    @property
    def end(self) -> int:
        return self.start + self.image.plan.span_length


def expand_images(ids: list[int], images: list[ImageInput], image_token_id: int) -> tuple[list[int], tuple[PromptImage, ...]]:
    """Replace the k-th `image_token_id` of `ids` by the k-th image's span; → (ids, the spans)."""
    n_marks = sum(t == image_token_id for t in ids)
    if n_marks != len(images):
        raise ImageError(f"the prompt has {n_marks} image placeholder token(s) (id {image_token_id}) but "
                         f"{len(images)} image(s) were given")
    out, spans, pending = [], [], iter(images)
    for token in ids:
        if token != image_token_id:
            out.append(token)
            continue
        image = next(pending)
        spans.append(PromptImage(len(out), image))
        out += [image_token_id] * image.plan.span_length
    return out, tuple(spans)


def check_spans(prompt: tuple[int, ...], spans: tuple[PromptImage, ...], image_token_id: int | None) -> None:
    """Spans in order, apart, inside the prompt, each over `image_token_id` positions."""
    if spans and image_token_id is None:
        raise ImageError("this model has no vision encoder; the request carries images")
    end = 0
    for k, span in enumerate(spans):
        if span.start < end:
            raise ImageError(f"image span {k} starts at {span.start}, inside the span before it (ends at {end})")
        if span.end > len(prompt):
            raise ImageError(f"image span {k} ends at {span.end}, past the prompt's {len(prompt)} tokens")
        if any(t != image_token_id for t in prompt[span.start:span.end]):
            raise ImageError(f"image span {k} (positions {span.start} … {span.end - 1}) holds tokens other than "
                             f"the image token {image_token_id}")
        end = span.end


def token_types(length: int, spans: tuple[PromptImage, ...]) -> list[int]:
    """The type of every position: TEXT, or the span's own types."""
    types = [TEXT] * length
    for span in spans:
        types[span.start:span.end] = span.image.plan.token_types()
    return types


def position_keys(tokens, spans: tuple[PromptImage, ...]) -> tuple:
    """One key per position: the token id, or (digest, offset) inside an image span — equal keys, equal inputs."""
    keys = list(tokens)
    for span in spans:
        n = min(span.end, len(keys)) - span.start
        keys[span.start:span.start + max(n, 0)] = [(span.image.digest, i) for i in range(max(n, 0))]
    return tuple(keys)


def span_rows(image: ImageInput, cells: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
              newline: torch.Tensor) -> torch.Tensor:
    """[L, D]: the delimiters' learned vectors and the aligner's rows `cells` [M, D] in reading order."""
    types = torch.tensor(image.plan.token_types(), device=cells.device)
    rows = torch.empty(types.numel(), cells.shape[-1], dtype=cells.dtype, device=cells.device)
    rows[types == IMAGE_START] = start.to(cells.dtype)
    rows[types == IMAGE_END] = end.to(cells.dtype)
    rows[types == IMAGE_NEW_LINE] = newline.to(cells.dtype)
    rows[types == IMAGE] = cells
    return rows


@dataclass(frozen=True)
class SpanRows:
    """The image-span positions of one call: `index` [n] into its packed tokens, `rows` [n, D] their
    embeddings, `types` [N] every token's type (TEXT outside spans)."""

    index: torch.Tensor
    rows: torch.Tensor
    types: torch.Tensor


def call_rows(pieces: list[tuple[int, int, int, list[tuple[PromptImage, torch.Tensor]]]], n_tokens: int,
              device=None) -> SpanRows | None:
    """The SpanRows of a call from its rows' prompt pieces.

    `pieces`: per call row, (offset of its first token in the call, first position, positions fed, the
    row's spans with their encoded [L, D] rows). None when no span position is fed."""
    index, rows, types = [], [], torch.full((n_tokens,), TEXT, dtype=torch.long)
    for offset, first, count, spans in pieces:
        for span, encoded in spans:
            a, b = max(first, span.start), min(first + count, span.end)
            if a >= b:
                continue
            at = offset + a - first
            index.append(torch.arange(at, at + b - a))
            rows.append(encoded[a - span.start:b - span.start])
            types[at:at + b - a] = torch.tensor(span.image.plan.token_types()[a - span.start:b - span.start])
    if not index:
        return None
    return SpanRows(torch.cat(index).to(device), torch.cat(rows).to(device), types.to(device))
