"""benchmarks/bench_reference.py's accounting of a batch decode step: the multiply-adds its weights cost."""

import torch

from benchmarks.bench_reference import config, decode_multiply_adds
from dsv41.config import RuntimeConfig
from dsv41.model import Transformer


def _meta_model(**runtime) -> Transformer:
    return Transformer(config(256, 8), RuntimeConfig(max_seq_len=64, max_batch_size=16, **runtime), device="meta")


def test_a_steps_multiply_adds_count_each_rows_dense_weights_and_its_chosen_experts():
    held, stored = _meta_model(numerics="fast"), _meta_model(numerics="fast", stored_experts=True)
    cfg = held.cfg
    dense = sum(p.numel() for name, p in held.named_parameters()
                if not name.startswith("embed.") and ".ffn.experts." not in name)
    # each chosen expert: w1, w3 [inter, dim] and w2 [dim, inter], one multiply-add per value per row
    experts = cfg.n_layers * cfg.n_activated_experts * 3 * cfg.dim * cfg.moe_inter_dim
    for rows in (1, 16):
        assert decode_multiply_adds(held, rows) == rows * (dense + experts)
        # fp4 bytes hold two values each: the stored bank multiplies as many values as the held one
        assert decode_multiply_adds(stored, rows) == decode_multiply_adds(held, rows)


def test_the_count_leaves_out_the_embedding_and_the_unchosen_experts():
    model = _meta_model(numerics="fast")
    total = sum(p.numel() for p in model.parameters() if p.dtype.is_floating_point)
    assert decode_multiply_adds(model, 1) < total - model.embed.weight.numel()
    assert torch.tensor(decode_multiply_adds(model, 4)) == 4 * decode_multiply_adds(model, 1)
