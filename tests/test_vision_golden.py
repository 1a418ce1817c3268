"""The vision path against the public reference's recording (tests/golden/vision/, written by
`tools/reference_parity.py --cases vision --record tests/golden`): a prompt with one image span, made
from a stored PNG, through the processor, the ViT, the aligner, the span merge and `bias_vl` routing,
then 16 decode steps with DSpark drafts.

The processor's patches must equal the reference's bit for bit (Pillow's resampling is integer
arithmetic). The last-position logits of every call are compared as a relative RMS, as in
tests/test_golden.py: on the recording machine `kernels="blas"` is bit-identical (0) and the exact-sum
kernels land 0.009 away (another summation order); the bound is 0.04. The two wiring mistakes below land
0.14–0.16 away; each must exceed 0.1. (The draft logits are not in the distance here: under exact sums
one greedy draft flips to a near-tie neighbour, and the rows after it then draft from another token.
Routing by `bias_vl` cannot show in this config, where every expert is active;
tests/test_vision_engine.py checks it.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.config import RuntimeConfig
from dsv41.model import Transformer
from dsv41.model import transformer as transformer_module
from dsv41.model.init import init_random_
from dsv41.parity import decode_trace
from dsv41.vision import encoder
from dsv41.vision.processor import load_image
from dsv41.vision.spans import PromptImage, call_rows

from test_golden import load_golden

GOLDEN = Path(__file__).parent / "golden" / "vision" / "vision-seed0.safetensors"
TOLERANCE, CAUGHT = 0.04, 0.1


def deviation(got: dict, golden: dict) -> float:
    return float((got["logits"] - golden["logits"]).norm() / golden["logits"].norm())


@pytest.fixture(scope="module")
def golden():
    cfg, seed, prefill, want = load_golden(GOLDEN)
    return cfg, seed, prefill, want


def _span(cfg, want) -> PromptImage:
    image = load_image(bytes(want["picture"].numpy()), cfg)
    types = want["token_types"][0]
    start = int((types >= 0).nonzero()[0])
    return PromptImage(start, image)


def run(golden, kernels: str = "invariant"):
    cfg, seed, prefill, want = golden
    model = init_random_(Transformer(cfg, RuntimeConfig(max_seq_len=2 * want["ids"].shape[1], kernels=kernels)), seed)
    span = _span(cfg, want)
    rows = call_rows([(0, 0, prefill, [(span, model.encode_image(span.image))])], prefill)
    trace = decode_trace(model, want["ids"], prefill, rows)
    return {k: torch.cat(v) for k, v in trace.items() if v}


def test_patches_equal_the_reference_processor(golden):
    cfg, _, _, want = golden
    span = _span(cfg, want)
    assert torch.equal(span.image.patches, want["patches"])
    assert span.image.plan.token_types() == want["token_types"][0, span.start:span.end].tolist()


@pytest.mark.parametrize("kernels", ["invariant", "blas"])
def test_vl_prompt_matches_the_reference_recording(golden, kernels):
    got, want = run(golden, kernels), golden[3]
    assert deviation(got, want) <= TOLERANCE
    margin = want["logits"].topk(2, -1).values
    clear = (margin[:, 0] - margin[:, 1]) > 0.5
    assert torch.equal(got["logits"].argmax(-1)[clear], want["logits"].argmax(-1)[clear])


# ------------------------------------------------------------------------------------------ mutations
ORIGINAL_ROWS, ORIGINAL_ROPE = transformer_module.span_rows, encoder.rope_2d


def _start_and_end_swapped(image, cells, start, end, newline):
    return ORIGINAL_ROWS(image, cells, end, start, newline)


def _rope_columns_first(n_vit_h, n_vit_w, width, theta, device=None):
    cos, sin = ORIGINAL_ROPE(n_vit_h, n_vit_w, width, theta, device)
    swap = lambda t: torch.cat(t.chunk(2, dim=-1)[::-1], dim=-1)
    return swap(cos), swap(sin)


MUTATIONS = {
    "IMAGE_START and IMAGE_END rows swapped (§16.5)": (transformer_module, "span_rows", _start_and_end_swapped),
    "2D RoPE angles column first (§16.3)": (encoder, "rope_2d", _rope_columns_first),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_each_vision_wiring_mistake_is_caught(golden, mutation, monkeypatch):
    owner, name, broken = MUTATIONS[mutation]
    monkeypatch.setattr(owner, name, broken)
    assert deviation(run(golden), golden[3]) > CAUGHT
