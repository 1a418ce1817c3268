"""Shared test helpers: tiny configs that cover every layer role, model builders and slow references.

Layer layout of the tiny configs (8 backbone layers, like the release's roles in miniature):

| layer | r | role                                                                    |
|-------|---|-------------------------------------------------------------------------|
| 0, 1  | 0 | window only                                                             |
| 2     | 2 | kv source + index source (pooled groups of 2, r = 2 compressor)         |
| 3     | 2 | consumer of 2                                                           |
| 4     | 1 | kv source + index source + candidate source (r = 1 compressor)          |
| 5     | 1 | consumer of 4                                                           |
| 6     | 1 | index source only (keys of 4), candidate user (blocks of 4)             |
| 7     | 1 | consumer: KV of 4, top-K of 6                                           |
| 8, 9  | 0 | DSpark stages (not run by the backbone; present so the config has them) |

The window is 8 positions, so any test with more than 8 positions crosses the ring's wrap-around.

- `nonbinding_config`: every expert active, `index_topk` and the candidate stage larger than any
  position count the tests reach (max_seq_len 64), so no discrete choice can flip between two
  numerically different paths (docs/ARCHITECTURE.md §17 trap 23).
- `binding_config`: top-2 of 4 experts, `index_topk` 4, 2 candidate blocks of 2: every discrete choice
  is live.
"""

from __future__ import annotations


import torch

from dsv41.config import RELEASED_CONFIG, ModelConfig, RuntimeConfig  # noqa: F401 (re-exported to tests)
from dsv41.model.init import init_random_
from dsv41.model import Transformer

MAX_SEQ = 64  # cache and rotary reach of every tiny-model test

_TINY = dict(
    vocab_size=256, dim=64, moe_inter_dim=32, n_layers=8, n_heads=4, n_routed_experts=4, n_shared_experts=1,
    q_lora_rank=32, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32, window_size=8,
    compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0), kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
    index_n_heads=2, index_head_dim=32, candidate_source_layer=4, candidate_block_size=2,
    route_scale=1.5, swiglu_limit=10.0, original_seq_len=64, rope_factor=4, compress_rope_theta=160000.0,
    n_mtp_layers=2, dspark_block_size=5, dspark_noise_token_id=255, dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_n_activated_experts=2,
)


def nonbinding_config(**changes) -> ModelConfig:
    """All experts active; top-K and candidate stage wider than any reachable position count."""
    cfg = dict(_TINY, n_activated_experts=4, index_topk=MAX_SEQ, candidate_topk_blocks=MAX_SEQ)
    cfg.update(changes)
    return ModelConfig(**cfg)


def binding_config(**changes) -> ModelConfig:
    """Top-2 of 4 experts, top-4 compressed positions, 2 candidate blocks of 2: every choice is live."""
    cfg = dict(_TINY, n_activated_experts=2, index_topk=4, candidate_topk_blocks=2)
    cfg.update(changes)
    return ModelConfig(**cfg)


def without_dspark(cfg: ModelConfig) -> ModelConfig:
    """The same backbone with no DSpark stages (n_mtp_layers = 0)."""
    return cfg.replace(n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=(),
                       compress_ratios=cfg.compress_ratios[:cfg.n_layers])


def build(cfg: ModelConfig, numerics: str = "fast", *, seed: int = 0, stale_index_keys: bool = False,
          max_seq_len: int = MAX_SEQ, kernels: str | None = None) -> Transformer:
    dtype = "float32" if numerics == "fast" else "bfloat16"
    runtime = RuntimeConfig(max_seq_len=max_seq_len, numerics=numerics, dtype=dtype, kernels=kernels,
                            stale_index_keys=stale_index_keys)
    return init_random_(Transformer(cfg, runtime), seed)


def token_ids(batch: int, length: int, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def run_chunks(model: Transformer, ids: torch.Tensor, bounds: list[int]):
    """Feed ids in chunks [bounds[i], bounds[i+1]) to one fresh cache → (hidden [B, T, D], dspark [B, T, Dt])."""
    cache = model.new_cache(ids.shape[0], MAX_SEQ)
    hidden, dspark = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        out = model(ids[:, a:b], a, cache)
        hidden.append(out.hidden)
        dspark.append(out.dspark_hidden)
    return torch.cat(hidden, 1), (torch.cat(dspark, 1) if dspark[0] is not None else None)


def engine_run(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *, speculative: bool = False,
               sampling=None, seeds=None, n_slots: int | None = None, **engine_kw):
    """Completions of prompts run together on one engine (EOS ignored: the tiny configs have no tokenizer)."""
    from dsv41.engine.engine import Engine, EngineConfig
    from dsv41.engine.request import Request
    from dsv41.engine.sampling import SamplingParams

    sampling = sampling or SamplingParams(temperature=0.0)
    config = EngineConfig(n_slots=n_slots or len(prompts), speculative=speculative, **engine_kw)
    engine = Engine(model, None, config)
    for i, prompt in enumerate(prompts):
        engine.submit(Request(tuple(prompt), max_new_tokens=max_new_tokens, sampling=sampling, ignore_eos=True,
                              seed=None if seeds is None else seeds[i]))
    done = [e.completion for e in engine.run() if e.completion is not None]
    return sorted(done, key=lambda c: c.request)


@torch.no_grad()
def greedy_tokens(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding: a prefill of the prompt, then one single-token call per position."""
    cache = model.new_cache(1, model.runtime.max_seq_len)
    out = model(torch.tensor([prompt]), 0, cache)
    tokens = [int(model.logits(out.hidden[:, -1]).argmax())]
    for i in range(n - 1):
        out = model(torch.tensor([[tokens[-1]]]), len(prompt) + i, cache)
        tokens.append(int(model.logits(out.hidden[:, -1]).argmax()))
    return tokens


def rotate_reference(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False):
    """Slow §10 rotation in float64: pair (x[2i], x[2i+1]) of the LAST R features times exp(±i·p·ω_i).

    x [B, T, (heads,) F], positions [T], freqs [R/2] → float64 tensor of x's shape.
    """
    out = x.double().clone()
    R = 2 * freqs.numel()
    sign = -1.0 if inverse else 1.0
    for t, p in enumerate(positions.tolist()):
        for i in range(R // 2):
            # angle formed in fp32 like the reference, then exact complex multiplication
            angle = float(torch.tensor(float(p), dtype=torch.float32) * freqs[i].float())
            w = complex(torch.cos(torch.tensor(angle, dtype=torch.float64)),
                        sign * torch.sin(torch.tensor(angle, dtype=torch.float64)))
            re = out[:, t, ..., x.shape[-1] - R + 2 * i].clone()
            im = out[:, t, ..., x.shape[-1] - R + 2 * i + 1].clone()
            out[:, t, ..., x.shape[-1] - R + 2 * i] = re * w.real - im * w.imag
            out[:, t, ..., x.shape[-1] - R + 2 * i + 1] = re * w.imag + im * w.real
    return out


def picture(width: int = 97, height: int = 61, seed: int = 0) -> bytes:
    """PNG bytes of a seeded noise picture (the vision tests' images)."""
    import io

    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy(), "RGB").save(buf, "PNG")
    return buf.getvalue()
