"""Image prompts in the engine, on the random demo (a vision tower, routing that binds and ties):

- an image span gives the same tokens however it is fed: one chunk, chunks that cut the span, beside
  another request in one batch, speculatively (greedy speculation = plain greedy);
- each image is encoded once per request, and a continued prefix that holds it is never re-encoded; a
  different image at the same place is not taken for the kept one;
- image positions route with `bias_vl`, text positions with `bias` (trap 16);
- the span merge itself: delimiter rows and aligner rows land at their positions.
"""

from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41.chat import encode_messages
from dsv41.config import RuntimeConfig
from dsv41.engine.engine import Engine, EngineConfig, GenerationConfig
from dsv41.engine.sampling import SamplingParams
from dsv41.errors import ImageError
from dsv41.model import moe
from dsv41.tokenizer import Tokenizer
from dsv41.vision import ImageSources, prompt_images
from dsv41.vision.processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, load_image
from dsv41.vision.spans import PromptImage, call_rows

from helpers import picture

GREEDY = GenerationConfig(max_new_tokens=10, sampling=SamplingParams(temperature=0.0), ignore_eos=True)


@pytest.fixture(scope="module")
def demo(demo_dir):
    model = dsv41.load(demo_dir, RuntimeConfig(max_seq_len=256))
    return model, Tokenizer.from_dir(demo_dir)


def image_prompt(demo, images: list[bytes], text: str = "What is this?"):
    model, tokenizer = demo
    blocks = [{"type": "image", "data": data} for data in images] + [{"type": "text", "text": text}]
    rendered, media = encode_messages([{"role": "user", "content": blocks}], return_multi_modal_data=True)
    return prompt_images(tokenizer.encode_prompt(rendered), media["images"], model.cfg, ImageSources())


def run(model, tokenizer, requests, **engine):
    settings = dict(n_slots=len(requests), token_budget=512, prefill_chunk=512)
    e = Engine(model, tokenizer, EngineConfig(**{**settings, **engine}))
    ids = [e.submit(r) for r in requests]
    done = {ev.completion.request: ev.completion for ev in e.run() if ev.completion is not None}
    return [done[i] for i in ids], e


class EncodeCounter:
    def __init__(self, model, monkeypatch):
        self.digests, original = [], model.encode_image

        def counted(image):
            self.digests.append(image.digest)
            return original(image)
        monkeypatch.setattr(model, "encode_image", counted)


def test_the_span_is_expanded_from_the_placeholder(demo):
    model, tokenizer = demo
    ids, spans = image_prompt(demo, [picture(97, 61, 0)])
    [span] = spans
    assert ids.count(model.cfg.image_token_id) == span.image.plan.span_length
    assert ids[span.start:span.end] == [model.cfg.image_token_id] * span.image.plan.span_length
    # the placeholder's neighbours are the rendered text's
    text_ids = tokenizer.encode_prompt(encode_messages([{"role": "user", "content": [
        {"type": "image", "data": b"x"}, {"type": "text", "text": "What is this?"}]}]))
    mark = text_ids.index(model.cfg.image_token_id)
    assert ids[:span.start] == text_ids[:mark] and ids[span.end:] == text_ids[mark + 1:]


@pytest.mark.parametrize("chunk", [3, 7, 512])
def test_chunks_that_cut_the_span_give_the_tokens_of_one_prefill(demo, chunk):
    model, tokenizer = demo
    ids, spans = image_prompt(demo, [picture(97, 61, 0), picture(40, 90, 1)])
    whole, _ = run(model, tokenizer, [GREEDY.request(ids, spans)])
    cut, _ = run(model, tokenizer, [GREEDY.request(ids, spans)], prefill_chunk=chunk, token_budget=chunk)
    assert cut[0].token_ids == whole[0].token_ids


def test_an_image_row_beside_a_text_row_gives_its_tokens_alone(demo):
    model, tokenizer = demo
    ids, spans = image_prompt(demo, [picture(97, 61, 0)])
    text = tokenizer.encode_prompt(encode_messages([{"role": "user", "content": "Hello there"}]))
    alone, _ = run(model, tokenizer, [GREEDY.request(ids, spans)])
    text_alone, _ = run(model, tokenizer, [GREEDY.request(text)])
    both, _ = run(model, tokenizer, [GREEDY.request(text), GREEDY.request(ids, spans)])
    assert both[1].token_ids == alone[0].token_ids and both[0].token_ids == text_alone[0].token_ids


def test_the_image_changes_the_answer(demo):
    """A mutation check of the whole path: another picture, another continuation (random demo)."""
    model, tokenizer = demo
    outs = []
    for seed in (0, 1):
        ids, spans = image_prompt(demo, [picture(97, 61, seed)])
        outs.append(run(model, tokenizer, [GREEDY.request(ids, spans)])[0][0].token_ids)
    assert outs[0] != outs[1]


def test_speculative_greedy_equals_plain_greedy_with_an_image(demo_dir):
    model = dsv41.load(demo_dir, RuntimeConfig(max_seq_len=256))
    tokenizer = Tokenizer.from_dir(demo_dir)
    ids, spans = image_prompt((model, tokenizer), [picture(97, 61, 0)])
    config = GenerationConfig(max_new_tokens=16, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    plain, _ = run(model, tokenizer, [config.request(ids, spans)])
    spec, _ = run(model, tokenizer, [config.request(ids, spans)], speculative=True)
    assert spec[0].token_ids == plain[0].token_ids and spec[0].drafted > 0


def test_each_image_is_encoded_once_and_a_kept_prefix_not_again(demo, monkeypatch):
    model, tokenizer = demo
    counter = EncodeCounter(model, monkeypatch)
    first = [{"role": "user", "content": [{"type": "image", "data": picture(97, 61, 0)},
                                          {"type": "text", "text": "What is this?"}]}]
    rendered, media = encode_messages(first, return_multi_modal_data=True)
    ids, spans = prompt_images(tokenizer.encode_prompt(rendered), media["images"], model.cfg, ImageSources())
    # no image cache: what keeps the image from a second encoding is the reused prefix alone
    e = Engine(model, tokenizer, EngineConfig(n_slots=2, prefill_chunk=5, token_budget=5, image_cache=0))
    e.submit(GREEDY.request(ids, spans))
    [done] = [ev.completion for ev in e.run() if ev.completion is not None]
    assert len(counter.digests) == 1                       # over several chunks, one encoding
    follow = ids + done.token_ids + tokenizer.encode("And now?")
    e.submit(GREEDY.request(follow, spans))
    [again] = [ev.completion for ev in e.run() if ev.completion is not None]
    assert again.cached_tokens == len(ids) + len(done.token_ids) - 1 and len(counter.digests) == 1
    # the same positions with another picture: not the kept sequence
    other = load_image(picture(97, 61, 5), model.cfg)
    assert other.plan == spans[0].image.plan
    e.submit(GREEDY.request(follow, (PromptImage(spans[0].start, other),)))
    [cold] = [ev.completion for ev in e.run() if ev.completion is not None]
    assert cold.cached_tokens == 0 and counter.digests[-1] == other.digest


@pytest.mark.parametrize("kept, encodings", [(None, 1), (0, 2)])
def test_the_same_picture_in_two_requests_is_encoded_once(demo, monkeypatch, kept, encodings):
    """The engine's image cache (by digest): two choices of one prompt share the encoding; without the
    cache each encodes its own. Both give the same tokens either way."""
    model, tokenizer = demo
    counter = EncodeCounter(model, monkeypatch)
    ids, spans = image_prompt(demo, [picture(97, 61, 0)])
    done, engine = run(model, tokenizer, [GREEDY.request(ids, spans)] * 2, image_cache=kept)
    assert len(counter.digests) == encodings == engine.stats.images_encoded
    assert done[0].token_ids == done[1].token_ids


def test_image_positions_route_with_bias_vl(demo, monkeypatch):
    """With bias_vl favouring experts {0, 1} and bias experts {6, 7} by far, every image position picks
    {0, 1} and every text position {6, 7}, in every MoE layer."""
    model, tokenizer = demo
    ids, spans = image_prompt(demo, [picture(97, 61, 0)])
    seen, saved = [], []
    for router in [m for m in model.modules() if isinstance(m, moe.Router)]:
        n = router.bias.numel()
        saved.append((router, router.bias.data.clone(), router.bias_vl.data.clone()))
        router.bias.data.fill_(-1e4).index_fill_(0, torch.tensor([n - 2, n - 1]), 1e4)
        router.bias_vl.data.fill_(-1e4).index_fill_(0, torch.tensor([0, 1]), 1e4)
    original = moe.MoE.route

    def spy(self, x, image_mask=None):
        weights, chosen = original(self, x, image_mask)
        seen.append((image_mask, chosen))
        return weights, chosen
    monkeypatch.setattr(moe.MoE, "route", spy)
    cache = model.new_cache(1)
    rows = call_rows([(0, 0, len(ids), [(spans[0], model.encode_image(spans[0].image))])], len(ids))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), 0, cache, images=rows)
    finally:
        for router, bias, bias_vl in saved:
            router.bias.data.copy_(bias)
            router.bias_vl.data.copy_(bias_vl)
    n = seen and seen[0][1].shape[-1]
    image = torch.zeros(len(ids), dtype=torch.bool)
    image[spans[0].start:spans[0].end] = True
    assert len(seen) == model.cfg.n_layers
    for mask, chosen in seen:
        assert torch.equal(mask, image)
        assert chosen[image].sort(-1).values.tolist() == [[0, 1]] * int(image.sum())
        n_experts = model.cfg.n_routed_experts
        assert chosen[~image].sort(-1).values.tolist() == [[n_experts - 2, n_experts - 1]] * int((~image).sum())
    assert n == model.cfg.n_activated_experts


def test_span_rows_put_delimiters_and_cells_in_reading_order(demo):
    model, _ = demo
    image = load_image(picture(97, 61, 0), model.cfg)
    rows = model.encode_image(image)
    types = torch.tensor(image.plan.token_types())
    for kind, vector in ((IMAGE_START, model.image_start), (IMAGE_END, model.image_end),
                         (IMAGE_NEW_LINE, model.image_newline)):
        assert torch.equal(rows[types == kind], vector.expand(int((types == kind).sum()), -1))
    plan = image.plan
    cells = model.aligner(model.vision(image.patches, plan.n_vit_h, plan.n_vit_w), plan.n_vit_h, plan.n_vit_w)
    assert torch.equal(rows[types == IMAGE], cells)
    assert rows.shape == (plan.n_h * (plan.n_w + 1) + 2, model.cfg.dim)


def test_bad_image_inputs_are_refused_by_name(demo):
    model, tokenizer = demo
    ids, spans = image_prompt(demo, [picture(97, 61, 0)])
    e = Engine(model, tokenizer, EngineConfig(n_slots=1))
    with pytest.raises(ImageError, match="holds tokens other than the image token"):
        e.submit(GREEDY.request([ids[0]] * len(ids), spans))
    with pytest.raises(ImageError, match="past the prompt"):
        e.submit(GREEDY.request(ids[:spans[0].end - 1], spans))
    with pytest.raises(ImageError, match="2 image\\(s\\) were given"):
        prompt_images(ids[:spans[0].start] + [model.cfg.image_token_id],
                      [{"data": picture(20, 20, k)} for k in range(2)], model.cfg, ImageSources())


def test_image_positions_are_dead_to_engram(demo, monkeypatch):
    """The span's positions are DEAD in the hash history and get no Engram contribution (gate 0), in
    both Engram layers; text positions get one."""
    from dsv41.model.engram import DEAD
    from dsv41.model.engram.module import Engram

    model, _ = demo
    ids, spans = image_prompt(demo, [picture(97, 61, 0)])
    image = torch.zeros(len(ids), dtype=torch.bool)
    image[spans[0].start:spans[0].end] = True
    changes = []
    original = Engram.forward

    def spy(self, x, rows, text_mask=None):
        out = original(self, x, rows, text_mask)
        changes.append((out.float() - x.float()).abs().amax(dim=(-1, -2))[0])      # [T]
        return out
    monkeypatch.setattr(Engram, "forward", spy)
    cache = model.new_cache(1)
    rows = call_rows([(0, 0, len(ids), [(spans[0], model.encode_image(spans[0].image))])], len(ids))
    with torch.no_grad():
        model(torch.tensor([ids]), 0, cache, images=rows)
    assert len(changes) == len(model.cfg.engram_layer_ids)
    for change in changes:
        assert torch.all(change[image] == 0) and torch.all(change[~image] > 0)
    history = cache.engram_history.ids[0, :len(ids)]
    assert torch.all(history[image] == DEAD) and torch.all(history[~image] != DEAD)


def test_inspect_counts_the_demo_vision_tower_under_its_own_labels(demo_dir, demo):
    """Counted by hand from the demo's widths (Dv 64, 2 blocks, Iv 128, 14² RGB patches, r 3, D 128)."""
    from dsv41.inspect import inspect_model

    model, _ = demo
    acc = inspect_model(demo_dir / "config.json").accounting
    block = (64 * 192 + 192) + (64 * 64 + 64) + 64 * 256 + 128 * 64 + 2 * 64     # wqkv, wo, w1, w2, norms
    vit = (588 * 64 + 64) + 2 * block + 64                                       # patch embedding, final norm
    aligner = (576 * 128 + 128) + (128 * 128 + 128)
    assert acc.value("vision") == vit == 120_448 and acc.value("aligner") == aligner == 90_368
    assert acc.value("image_markers") == 3 * 128
    held = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("vision.", "aligner.", "image_")))
    assert held == vit + aligner + 3 * 128
