"""A V4.1 model in trainable form: the inference `Transformer` in fast float32, with fp32 Engram tables.

Shapes: R Engram table rows, De Engram row width.

Every parameter the checkpoint stores in fp8 / fp4 / bf16 is held here as an fp32 master and trained
by gradient, except the routers' selection biases, which the auxiliary-loss-free balancing moves from
the experts' load (`balance_experts`, docs/TRAINING.md §3). The Engram tables, fp8 rows in the model,
are fp32 parameters here and are quantised into the model's tables on export (`export`). A trained
model is written in the released layout by the same writer as any checkpoint and loads through the
normal loader.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.model_io import load_model, save_model
from ..config import ModelConfig, RuntimeConfig
from ..model import Transformer
from ..model.engram.table import EngramTable
from ..model.formats import quantize_fp8_rows
from ..model.init import init_random_
from ..model.layers import RMSNorm


def training_runtime(max_seq_len: int) -> RuntimeConfig:
    return RuntimeConfig(max_seq_len=max_seq_len, dtype="float32", numerics="fast")


def is_balanced(name: str) -> bool:
    """The routers' selection biases: moved by expert load, never by gradient (§13)."""
    return name.endswith(("gate.bias", "gate.bias_vl"))


class TrainingModel(nn.Module):
    def __init__(self, transformer: Transformer, engram_tables: list[torch.Tensor]):
        super().__init__()
        self.transformer = transformer
        self.engram_tables = nn.ParameterList(nn.Parameter(t.float()) for t in engram_tables)
        for name, p in transformer.named_parameters():
            if isinstance(_owner(transformer, name), EngramTable):
                continue                                     # fp8 bytes, rewritten by `export`
            if p.is_floating_point():
                p.data = p.data.float()
            p.requires_grad_(not is_balanced(name))

    @classmethod
    def create(cls, cfg: ModelConfig, token_map: torch.Tensor, *, max_seq_len: int, seed: int = 0) -> "TrainingModel":
        """A freshly initialised model (`init_for_training`)."""
        transformer = Transformer(cfg, training_runtime(max_seq_len), token_map=token_map)
        with torch.no_grad():
            init_for_training(transformer, seed)
        gen = torch.Generator().manual_seed(seed)
        tables = [torch.randn(t.rows, t.head_dim, generator=gen) for t in engram_tables_of(transformer)]
        return cls(transformer, tables)

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, max_seq_len: int) -> "TrainingModel":
        """A released-layout checkpoint, dequantised into trainable fp32 (fine-tuning, or checking an export)."""
        transformer = load_model(path, training_runtime(max_seq_len), check_memory=False, progress=False)
        tables = [t.lookup(torch.arange(t.rows).unsqueeze(1)).squeeze(1).float() for t in engram_tables_of(transformer)]
        return cls(transformer, tables)

    @property
    def cfg(self) -> ModelConfig:
        return self.transformer.cfg

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def balance_experts(self, loads: list[tuple[nn.Module, torch.Tensor]], rate: float) -> None:
        """bias_e += rate · sign(mean load − load_e) for every MoE, from the counts of the step's calls
        (DeepSeek-V3's auxiliary-loss-free balancing): an overloaded expert is chosen less next step."""
        totals: dict[int, tuple[nn.Module, torch.Tensor]] = {}
        for moe, counts in loads:
            prior = totals.get(id(moe))
            totals[id(moe)] = (moe, counts if prior is None else prior[1] + counts)
        for moe, counts in totals.values():
            load = counts.float()
            moe.gate.bias += rate * torch.sign(load.mean() - load)

    @torch.no_grad()
    def export(self, directory: str | Path, *, tokenizer: str | Path, keep_bf16: bool = False) -> Path:
        """Write the released layout: dense weights fp8 and experts fp4 as the config says (or bf16 with
        keep_bf16), Engram tables fp8 with ue8m0 scales per 32 (§9), the tokenizer files beside them."""
        for table, trained in zip(engram_tables_of(self.transformer), self.engram_tables):
            weight, scale = quantize_fp8_rows(trained.detach())
            table.weight.data.copy_(weight)
            table.scale.data.copy_(scale)
        cfg = self.cfg
        if keep_bf16:
            cfg = replace(cfg, dtype="bf16", expert_dtype=None)
        return save_model(self.transformer, directory, cfg=cfg, tokenizer=tokenizer)


def engram_tables_of(transformer: Transformer) -> list[EngramTable]:
    """The model's Engram tables in Engram-layer order."""
    blocks = sorted((b for b in transformer.layers if b.engram is not None), key=lambda b: b.role.engram_index)
    return [b.engram.embed for b in blocks]


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def init_for_training(model: Transformer, seed: int) -> Transformer:
    """`init_random_`, then what makes a deep residual stack train from scratch: neutral norms, gates
    and sinks, zero router biases (balancing moves them), and the sublayers' output projections (wo_b,
    experts' w2) scaled by 1/√(2·layers), so the streams do not grow with depth (GPT-2's rule)."""
    init_random_(model, seed)
    depth = 1 / math.sqrt(2 * (model.cfg.n_layers + model.cfg.n_mtp_layers))
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if is_balanced(name) or leaf == "attn_sink":
            p.data.zero_()
        elif leaf in ("q_weight", "k_weight"):
            p.data.fill_(1.0)
        elif name.endswith(("attn.wo_b.weight", "w2.weight")):
            p.data.mul_(depth)
    return model
