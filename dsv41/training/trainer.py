"""The training loop: AdamW, warm-up + cosine, clipping, accumulation, balancing, evaluation, resume.

One optimizer step = `grad_accum` micro-batches of `batch_size` sequences, their gradients summed
(each loss divided by grad_accum), clipped to `clip` global norm, then AdamW; after the step the routers'
biases move from the step's expert load. Every `eval_every` steps the held-out perplexity is measured;
every `save_every` steps (and at the end) the whole state is written atomically to `state.pt`: model,
optimizer, scheduler position, step and history. Batches depend only on (seed, step, micro-batch) and
nothing else draws random numbers, so a run resumed from `state.pt` continues bit for bit as if it
had never stopped (tests/test_training.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import UserError
from .data import TokenData
from .model import TrainingModel
from .objective import compute_losses, evaluate

STATE_FILE = "state.pt"
HISTORY_FILE = "history.jsonl"
CURVE_FILE = "loss.png"


class TrainingError(UserError):
    """Settings or a saved state that cannot train; the message names the culprit."""


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    precision: str = "fp32"
    """"fp32", or "bf16": the forward under bf16 autocast, fp32 master weights and optimizer."""
    index_kl_weight: float = 1.0
    dspark_weight: float = 1.0
    bias_update_rate: float = 1e-3
    eval_every: int = 100
    eval_sequences: int = 64
    save_every: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "grad_accum", "eval_every", "save_every", "eval_sequences")
        for name in positive:
            if getattr(self, name) < 1:
                raise TrainingError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise TrainingError(f"seq_len must be at least 2 (BOS and one token), got {self.seq_len}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise TrainingError(f"lr must be positive and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if self.warmup < 0 or self.clip <= 0:
            raise TrainingError(f"warmup must be ≥ 0 and clip > 0, got {self.warmup}, {self.clip}")
        if self.precision not in ("fp32", "bf16"):
            raise TrainingError(f"precision must be fp32 or bf16, got {self.precision!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSettings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TrainingError(f"unknown training settings {unknown}; known: {sorted(known)}")
        if "betas" in d:
            d = dict(d, betas=tuple(d["betas"]))
        return cls(**d)

    def learning_rate(self, step: int) -> float:
        """lr at optimizer step `step` (0-based): linear warm-up, then cosine down to min_lr_ratio · lr."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: TrainingModel, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norms, sinks, mix biases and scales) do not."""
    decay, plain = [], []
    for _, p in model.trainable():
        (decay if p.dim() >= 2 else plain).append(p)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas)


class Trainer:
    def __init__(self, model: TrainingModel, data: TokenData, settings: TrainSettings, out: str | Path, *,
                 progress: bool | None = None):
        if settings.seq_len > model.transformer.runtime.max_seq_len:
            raise TrainingError(f"seq_len {settings.seq_len} exceeds the model's context "
                                f"{model.transformer.runtime.max_seq_len}")
        self.model, self.data, self.settings = model, data, settings
        self.out = Path(out)
        self.optimizer = make_optimizer(model, settings)
        self.step = 0
        self.history: list[dict] = []
        self.progress = progress
        self.eval_sequences = data.evaluation(settings.seq_len, settings.eval_sequences) if data.validation.numel() else None

    # ---------------------------------------------------------------------------------- state
    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                "history": self.history, "settings": asdict(self.settings)}

    def save(self) -> Path:
        """Write state.pt atomically (a crash mid-write leaves the previous one) and the history and curve."""
        self.out.mkdir(parents=True, exist_ok=True)
        target = self.out / STATE_FILE
        partial = target.with_suffix(".pt.partial")
        torch.save(self.state(), partial)
        os.replace(partial, target)
        (self.out / HISTORY_FILE).write_text("".join(json.dumps(h) + "\n" for h in self.history))
        write_curve(self.history, self.out / CURVE_FILE)
        return target

    def resume(self) -> bool:
        """Continue from out/state.pt if it exists (the settings must match); → whether it did."""
        path = self.out / STATE_FILE
        if not path.is_file():
            return False
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise TrainingError(f"{path}: not a readable training state ({type(e).__name__}: {e})") from None
        saved = TrainSettings.from_dict(state["settings"])
        if saved != self.settings:
            changed = sorted(k for k, v in asdict(saved).items() if asdict(self.settings)[k] != v)
            raise TrainingError(f"{path} was saved with other settings ({', '.join(changed)}); resume with the "
                                f"same settings or train into another --out directory")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history = state["step"], state["history"]
        return True

    # ---------------------------------------------------------------------------------- the loop
    def train_step(self) -> dict:
        """One optimizer step; → its figures."""
        s, model = self.settings, self.model
        for group in self.optimizer.param_groups:
            group["lr"] = s.learning_rate(self.step)
        loads, sums = [], {}
        for micro in range(s.grad_accum):
            ids = self.data.batch(s.seed, self.step, micro, s.batch_size, s.seq_len)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.precision == "bf16"):
                losses = compute_losses(model, ids, index_kl_weight=s.index_kl_weight,
                                        dspark_weight=s.dspark_weight, anchor_offset=self.step + micro)
            (losses.total / s.grad_accum).backward()
            loads.extend(losses.loads)
            for k, v in losses.figures().items():
                sums[k] = sums.get(k, 0.0) + v / s.grad_accum
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in model.trainable()], s.clip)
        if not torch.isfinite(norm):
            raise TrainingError(f"step {self.step}: the gradient norm is {float(norm)}; lower --lr or use fp32")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        model.balance_experts(loads, s.bias_update_rate)
        self.step += 1
        return dict(sums, step=self.step, lr=s.learning_rate(self.step - 1), grad_norm=float(norm))

    def run(self, until: int | None = None) -> list[dict]:
        """Train to `settings.steps` (or stop after step `until`, saving there: a run in pieces)."""
        s = self.settings
        end = s.steps if until is None else min(until, s.steps)
        tokens_per_step = s.batch_size * s.seq_len * s.grad_accum
        bar = tqdm(total=s.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=None if self.progress is None else not self.progress, mininterval=1.0)
        started, first = time.perf_counter(), self.step
        while self.step < end:
            figures = self.train_step()
            rate = tokens_per_step * (self.step - first) / (time.perf_counter() - started)
            figures["tokens_per_s"] = rate
            if self.step % s.eval_every == 0 or self.step == s.steps:
                figures.update({f"val_{k}": v for k, v in self.evaluate().items()})
            self.history.append(figures)
            line = (f"loss {figures['lm']:.3f} draft {figures['draft']:.3f} {rate:,.0f} tok/s"
                    + (f" val ppl {figures['val_perplexity']:.1f}" if "val_perplexity" in figures else ""))
            bar.set_postfix_str(line)
            bar.update(1)
            if bar.disable and self.progress is not False and "val_perplexity" in figures:
                print(f"dsv41: step {self.step}/{s.steps}: {line}", flush=True)   # no terminal: a line per evaluation
            if self.step % s.save_every == 0 or self.step in (s.steps, end):
                self.save()
        bar.close()
        return self.history

    def evaluate(self) -> dict[str, float]:
        if self.eval_sequences is None:
            return {}
        return evaluate(self.model, self.eval_sequences, self.settings.batch_size)


def write_curve(history: list[dict], path: Path) -> None:
    """The loss curve (train next-token and draft losses per step, held-out loss where measured) as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["lm"] for h in history], lw=0.8, label="train next-token loss")
    if any(h.get("draft") for h in history):
        ax.plot(steps, [h["draft"] for h in history], lw=0.8, label="train DSpark draft loss")
    evals = [h for h in history if "val_lm" in h]
    if evals:
        ax.plot([h["step"] for h in evals], [h["val_lm"] for h in evals], "o-", ms=3, label="held-out next-token loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("nats per token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
