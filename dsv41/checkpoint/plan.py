"""The load plan: what a model will hold on each device, worked out on the meta device before a byte is read.

Built from the config, the runtime (numerics, context, batch, device), the Engram placement and the
world size, with no checkpoint data: the model is built on the meta device, so every figure is the size
of a tensor the real load would create (weights as the chosen numerics hold them, caches as the cache
allocates them), not a formula kept in step with the code by hand. Per rank, split tensors count their
slice, routed experts their rank's range and Engram tables ⌈rows/ws⌉ rows (docs/CHECKPOINT.md §5); caches are
replicated (one K = V latent, read by every head).

Transients are the largest temporary tensors, estimated from the code's shapes: while loading, a stored
tensor read whole before it is converted; while prefilling one chunk of T tokens, the residual streams,
the indexer's scores (bounded by its byte budget), the attention's gathered rows, the logits and, under
fast BLAS kernels, the experts' gathered weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..config import ModelConfig, RuntimeConfig
from ..errors import UserError
from .inventory import is_expert_stack, released_inventory, stored_names
from .sharding import ENGRAM_ROWS, SPLIT, allowed_world_sizes, check_parallel_sizes, engram_rows_per_rank, shard_rule

GiB = 2 ** 30
PREFILL_CHUNK = 512
"""Tokens of one prefill chunk the plan sizes its transient for (the engine's default chunk)."""



class PlanError(UserError):
    """The plan does not fit the memory available; the message carries the numbers and what would fit."""


def component_of(name: str) -> str:
    """The label a module tensor is counted under (the families of docs/CHECKPOINT.md §4)."""
    if name.startswith("mtp."):
        return "DSpark stages"
    if shard_rule(name).kind == ENGRAM_ROWS:
        return "Engram tables"
    if ".ffn.experts." in name:
        return "routed experts"
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("head."):
        return "head"
    if name.startswith(("vision.", "aligner.", "image_")):
        return "vision encoder"
    return "attention, shared experts, norms"


def _rank_bytes(name: str, tensor: torch.Tensor, world_size: int, ep_size: int) -> int:
    """Bytes of module tensor `name` one rank holds with tensor parallelism over `world_size` ranks and
    the routed experts over `ep_size` (every rank holds as many)."""
    if is_expert_stack(name):                      # a stack of routed experts: the rank's range of them
        return tensor.nbytes // ep_size
    if world_size == 1:
        return tensor.nbytes
    rule = shard_rule(name)
    if rule.kind == ENGRAM_ROWS:
        per_rank, _ = engram_rows_per_rank(tensor.shape[0], world_size)
        return per_rank * tensor[0].nbytes
    return tensor.nbytes // world_size if rule.kind == SPLIT else tensor.nbytes


def _stored_bytes(name: str, inventory: dict, n_stack: int) -> int:
    """Bytes the checkpoint stores for one module tensor (a stack of experts: all of them)."""
    return sum(inventory[s].nbytes for s in stored_names(name, n_stack) if s in inventory)


@dataclass(frozen=True)
class LoadPlan:
    """Bytes per rank, by what holds them. `where` says which memory each figure lives in."""

    numerics: str
    world_size: int
    """Tensor parallel size (query heads, vocabulary, Engram rows)."""
    context: int
    batch: int
    device: str
    engram_on_disk: bool
    weights: dict[str, int] = field(default_factory=dict)
    cache: int = 0
    load_transient: int = 0
    prefill_transient: dict[str, int] = field(default_factory=dict)
    ep_size: int | None = None
    """Expert parallel size (routed experts); None: the same as world_size."""

    @property
    def engram(self) -> int:
        return self.weights.get("Engram tables", 0)

    @property
    def on_disk(self) -> int:
        """Bytes left memory-mapped on disk (Engram tables with --engram-on-disk): page cache, not held."""
        return self.engram if self.engram_on_disk else 0

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values()) - self.on_disk

    @property
    def peak_prefill(self) -> int:
        """The residual streams live through the chunk; the other parts come one after another."""
        others = [n for k, n in self.prefill_transient.items() if k != "residual streams"]
        return self.prefill_transient.get("residual streams", 0) + max(others, default=0)

    @property
    def on_device(self) -> int:
        """Bytes the device (the host for `cpu`) must hold at the peak: weights, caches, the larger transient."""
        return self.weight_bytes + self.cache + max(self.load_transient, self.peak_prefill)

    def lines(self) -> list[str]:
        ep = "" if self.ep_size in (None, self.world_size) else f", experts over {self.ep_size}"
        out = [f"load plan: {self.numerics} numerics, world size {self.world_size}{ep}, context {self.context:,}, "
               f"batch {self.batch}, device {self.device}; per rank:"]
        for label, n in sorted(self.weights.items(), key=lambda kv: -kv[1]):
            where = " (memory-mapped from disk, not held)" if label == "Engram tables" and self.engram_on_disk else ""
            out.append(f"  {label:<34} {fmt_bytes(n):>11}{where}")
        out.append(f"  {'caches (all slots, whole context)':<34} {fmt_bytes(self.cache):>11}")
        out.append(f"  {'peak transient while loading':<34} {fmt_bytes(self.load_transient):>11}")
        out.append(f"  {'peak transient, prefill chunk':<34} {fmt_bytes(self.peak_prefill):>11} "
                   f"({PREFILL_CHUNK} tokens: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in
                                                          self.prefill_transient.items()) + ")")
        out.append(f"  {'needed at the peak':<34} {fmt_bytes(self.on_device):>11}")
        return out


def fmt_bytes(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:,.2f} GiB"
    return f"{n / 2 ** 20:,.1f} MiB"


# ---------------------------------------------------------------------------------------- context
def context_limit(cfg: ModelConfig) -> int | None:
    """The longest context the rope settings were made for: original_seq_len × rope_factor (YaRN, §10).

    None when the config has no original length (plain RoPE, no stated limit)."""
    if cfg.original_seq_len <= 0:
        return None
    return int(cfg.original_seq_len * max(cfg.rope_factor, 1.0))


def check_context(cfg: ModelConfig, context: int) -> None:
    limit = context_limit(cfg)
    if limit is not None and context > limit:
        raise PlanError(f"a context of {context:,} positions is longer than this model's rope settings support: "
                        f"original_seq_len {cfg.original_seq_len:,} × rope_factor {cfg.rope_factor:g} = {limit:,} "
                        f"(use --max-context {limit} or less)")


# ---------------------------------------------------------------------------------------- building
def meta_model(cfg: ModelConfig, runtime: RuntimeConfig):
    """The model `runtime` would build, with no storage: every tensor's shape and dtype, no bytes. Its
    policy is the runtime's device's (what a model there holds depends on it: fast bf16 with the
    native kernels keeps a bf16 head), its tensors are on the meta device."""
    from ..model import Transformer
    return Transformer(cfg, runtime, device="meta")


def cache_bytes(cfg: ModelConfig, runtime: RuntimeConfig, model=None) -> int:
    """Bytes of the cache the engine allocates: max_batch_size slots of max_seq_len positions."""
    model = model or meta_model(cfg, runtime)
    cache = model.new_cache(runtime.max_batch_size, runtime.max_seq_len)
    total = sum(t.nbytes for t in cache.window.values())
    for source in cache.sources.values():
        total += sum(t.nbytes for t in (source.kv, source.index_keys, source.tail_kv, source.tail_score)
                     if t is not None)
    if cache.engram_history is not None:
        total += cache.engram_history.ids.nbytes
    return total


def prefill_transient(cfg: ModelConfig, runtime: RuntimeConfig, tokens: int = PREFILL_CHUNK) -> dict[str, int]:
    """The largest temporaries of one prefill chunk, by part (estimates from the code's shapes)."""
    from ..model.indexer import indexer_transient_bytes
    T, context = tokens, runtime.max_seq_len
    width = 8 if runtime.numerics_policy.invariant else 4          # invariant kernels compute in float64
    parts = {"residual streams": 3 * T * cfg.hc_mult * cfg.dim * 4,
             "logits": T * cfg.vocab_size * 4}
    listed = cfg.window_size + (cfg.index_topk if any(cfg.compress_ratios) else 0)
    parts["attention rows"] = T * listed * (cfg.head_dim * 4 + cfg.n_heads * width)
    ratios = [r for r in cfg.compress_ratios if r]
    if ratios:
        parts["indexer scores"] = indexer_transient_bytes(
            T, context // min(ratios), cfg.index_n_heads, cfg.index_head_dim, runtime.indexer_budget_bytes,
            itemsize=runtime.torch_dtype.itemsize, invariant=runtime.numerics_policy.invariant)
    if runtime.numerics == "fast" and not runtime.numerics_policy.invariant:
        pairs = min(T * cfg.n_activated_experts, cfg.n_routed_experts - 1)
        if T * cfg.n_activated_experts < cfg.n_routed_experts:
            parts["gathered expert weights"] = pairs * 3 * cfg.moe_inter_dim * cfg.dim * 2
    return parts


def plan_load(cfg: ModelConfig, runtime: RuntimeConfig, *, world_size: int = 1, engram_on_disk: bool = False,
              model=None, inventory: dict | None = None, ep_size: int | None = None) -> LoadPlan:
    """The plan for loading `cfg` with `runtime` on each of `world_size` ranks (routed experts over
    `ep_size`, default `world_size`). Nothing is read.

    `model` (its single-process meta build) and `inventory` (its released layout) may be passed in when
    several plans of one config are made; a caller passing `inventory` has checked the sizes
    (allowed_world_sizes)."""
    ep = world_size if ep_size is None else ep_size
    if inventory is None:
        inventory = released_inventory(cfg)
        check_parallel_sizes(cfg, world_size, ep)
    model = model if model is not None else meta_model(cfg, runtime)
    weights: dict[str, int] = {}
    largest_read = 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        label = component_of(name)
        held = _rank_bytes(name, tensor, world_size, ep)
        weights[label] = weights.get(label, 0) + held
        if label == "Engram tables" and engram_on_disk:
            continue
        spec = inventory.get(name)
        if spec is None or spec.nbytes != tensor.nbytes or runtime.device != "cpu":
            # read whole into host memory, then converted or copied: the stored bytes are a transient
            stored = _stored_bytes(name, inventory, tensor.shape[0] if tensor.dim() else 1)
            largest_read = max(largest_read, stored * held // max(tensor.nbytes, 1))
    return LoadPlan(numerics=runtime.numerics, world_size=world_size, context=runtime.max_seq_len,
                    batch=runtime.max_batch_size, device=runtime.device, engram_on_disk=engram_on_disk,
                    weights=weights, cache=cache_bytes(cfg, runtime, model), load_transient=largest_read,
                    prefill_transient=prefill_transient(cfg, runtime), ep_size=ep_size)


# ---------------------------------------------------------------------------------------- memory
def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_available() -> tuple[int, str] | None:
    """(bytes, where the figure comes from) this process may still allocate on the host, or None."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        found.append((max(limit - used, 0), "the cgroup's memory.max"))
    override = os.environ.get("DSV41_MEMORY_LIMIT")
    if override and override.isdigit():
        found.append((int(override), "DSV41_MEMORY_LIMIT"))
    return min(found) if found else None


def device_available(device: str) -> tuple[int, str] | None:
    dev = torch.device(device)
    if dev.type == "cpu":
        return host_available()
    if dev.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(dev)
        return free, f"free memory of {device}"
    return None


def check_fits(cfg: ModelConfig, runtime: RuntimeConfig, plan: LoadPlan, *, available=None) -> None:
    """Raise PlanError with the numbers and what would fit when the plan exceeds the memory available."""
    available = device_available(runtime.device) if available is None else available
    if available is None:
        return
    free, source = available
    need = plan.on_device
    if need <= free:
        return
    head = (f"loading needs {fmt_bytes(need)} on {runtime.device} per rank; {fmt_bytes(free)} is available "
            f"({source}): weights {fmt_bytes(plan.weight_bytes)}, caches {fmt_bytes(plan.cache)} "
            f"({plan.batch} × {plan.context:,} positions), "
            f"transient {fmt_bytes(need - plan.weight_bytes - plan.cache)}")
    raise PlanError(head + "; " + "; ".join(_what_fits(cfg, runtime, plan, free)) + " (dsv41 check DIR prints "
                    "the plans)")


def _what_fits(cfg: ModelConfig, runtime: RuntimeConfig, plan: LoadPlan, free: int) -> list[str]:
    hints = []
    if plan.engram and not plan.engram_on_disk:
        on_disk = plan.on_device - plan.engram
        hints.append(f"--engram-on-disk would need {fmt_bytes(on_disk)}" + (" (fits)" if on_disk <= free else ""))
    if runtime.numerics == "fast":
        alt = plan_load(cfg, replace(runtime, numerics="reference", kernels=None, dtype="bfloat16"),
                        world_size=plan.world_size, engram_on_disk=plan.engram_on_disk)
        hints.append(f"reference numerics (weights kept in their stored formats) would need {fmt_bytes(alt.on_device)}")
    rest = plan.on_device - plan.cache
    if plan.cache and rest < free:
        per_position = plan.cache / plan.context
        fits = int((free - rest) / per_position) // 256 * 256
        if fits >= 256:
            hints.append(f"a context of {fits:,} would fit (--max-context)")
    larger = allowed_world_sizes(cfg, range(plan.world_size + 1, 65))
    inventory, model = released_inventory(cfg), meta_model(cfg, runtime)
    for ws in larger:
        alt = plan_load(cfg, runtime, world_size=ws, engram_on_disk=plan.engram_on_disk, model=model,
                        inventory=inventory)
        if alt.on_device <= free:
            hints.append(f"{ws} processes (tensor parallel) would need {fmt_bytes(alt.on_device)} each")
            break
    else:
        if larger:
            most = plan_load(cfg, runtime, world_size=larger[-1], engram_on_disk=True, model=model,
                             inventory=inventory)
            hints.append(f"even {larger[-1]} processes (the most the config allows) would need "
                         f"{fmt_bytes(most.on_device)} each with --engram-on-disk")
    return hints
