"""Load a model from a released-layout directory, and save one in the same layout (docs/CHECKPOINT.md).

Module state names are the checkpoint's names, with one exception: routed experts are stacked, so the
checkpoint's `…ffn.experts.{e}.w1.weight` is row e of the module's `…ffn.experts.w1.weight`. Every tensor
is converted from its stored format to the format the module holds, by one rule (`to_module_format`):
quantised → quantised is a copy, quantised → float dequantises (wo_a to bf16, everything under `fast`
numerics), float → float casts (ratio-2 compressor and head to fp32). Nothing else converts: a quantised
weight without its scale, or a stored form other than the one a quantised module holds, is refused before
any tensor is read (a cast of code values would load garbage). Saving applies the inverse rule
(`to_stored_format`), which is exact for weights that came from the stored format, and writes only what
the layout names.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, replace
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..model import formats
from ..model.arena import WeightArena, set_module_tensor
from ..config import ModelConfig, RuntimeConfig
from .inventory import EXPERT_STACK, PER_EXPERT, is_expert_stack, module_name_of, released_inventory, stored_names
from .sharding import ENGRAM_ROWS, SPLIT, check_parallel_sizes, rank_slice, shard_rule
from ..parallel.context import ParallelContext
from .progress import byte_progress
from ..errors import CheckpointError
from .plan import check_context, check_fits, plan_load
from .safetensors_io import CheckpointDir
from .spec import TensorSpec, torch_dtype
from .writer import DEFAULT_MAX_SHARD_BYTES, save_checkpoint


# Families of the release a text model does not hold (loaded when those parts exist; docs/CHECKPOINT.md §3).
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
DSPARK_PREFIX = "mtp."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# -------------------------------------------------------------------------------------- conversions
# Stored weights that mean nothing without their `.scale` (docs/CHECKPOINT.md §2): fp8 e4m3, packed fp4.
QUANTIZED_STORED = ("F8_E4M3", "I8")
_QUANTIZED_HELD = (torch.float8_e4m3fn, torch.int8)


def to_module_format(weight: torch.Tensor, scale: torch.Tensor | None, target: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """A stored weight (+ its scale) → the dtype the module parameter `target` holds (dequantise or cast),
    written into `out` where given (a weight arena's slot: no converted copy beside it).

    Casting code values is never a conversion: a quantised weight without its scale, or anything but a
    copy into a quantised target, is refused (a bf16 weight cast to e4m3 would load garbage silently).
    """
    if target.dtype == weight.dtype:
        return weight
    convert = (lambda v: v.to(target.dtype)) if out is None else out.copy_
    if target.dtype in _QUANTIZED_HELD:
        raise CheckpointError(f"a {weight.dtype} weight cannot become a quantised {target.dtype} one")
    if scale is None:
        if weight.dtype in _QUANTIZED_HELD:
            raise CheckpointError(f"a {weight.dtype} weight needs its scale to be dequantised")
        return convert(weight)
    if weight.dtype == torch.int8:
        return convert(formats.dequantize_fp4_weight(weight, scale))
    return convert(formats.dequantize_fp8_weight(weight, scale))


def to_stored_format(value: torch.Tensor, weight: TensorSpec, scale: TensorSpec | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A module tensor → (stored weight, stored scale) in the checkpoint's formats."""
    want = torch_dtype(weight.dtype)
    if value.dtype == want:
        return value, None
    if scale is None:
        return value.to(want), None
    if weight.dtype == "I8":
        return formats.quantize_fp4_weight(value.float())
    return formats.quantize_fp8_weight(value.float())


# -------------------------------------------------------------------------------------- name mapping
def _module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict(keep_vars=True))


def skipped_family(name: str, model: nn.Module) -> bool:
    """Stored tensors a text model legitimately leaves on disk: vision, and DSpark when not built."""
    if name.startswith(VISION_PREFIXES):
        return not hasattr(model, "vision")
    return name.startswith(DSPARK_PREFIX) and not hasattr(model, "mtp")


# -------------------------------------------------------------------------------------- loading
def _is_scale_of_quantized(name: str, tensors: dict[str, torch.Tensor]) -> bool:
    return name.endswith(".scale") and name[: -len("scale")] + "weight" in tensors and not name.endswith(
        ("hc_attn_scale", "hc_ffn_scale"))


def _format_problems(ckpt: CheckpointDir, sources: list[str], scales: list[str], target: torch.Tensor,
                     held_scale: torch.Tensor | None, stacked: bool, part: tuple[int, int] | None) -> list[str]:
    """Why the stored weights cannot become `target` by dequantising, casting or copying ([] if they can).

    `held_scale` is the module's scale when it keeps the weight quantised; then the stored weight must be
    in that very format, with a scale of the held shape (per expert for stacked experts)."""
    problems = []
    for weight, scale in zip(sources, scales or [None] * len(sources)):
        stored = ckpt.spec(weight)
        has_scale = scale is not None and scale in ckpt
        if stored.dtype in QUANTIZED_STORED and not has_scale:
            problems.append(f"{weight} is {stored.dtype} but its scale {scale} is missing")
        elif stored.dtype not in QUANTIZED_STORED and has_scale:
            problems.append(f"{weight} is {stored.dtype}, not quantised, but has a scale {scale}")
        elif has_scale and ckpt.spec(scale).dtype != "F8_E8M0":
            problems.append(f"{scale} is {ckpt.spec(scale).dtype}, not F8_E8M0")
        elif held_scale is not None and torch_dtype(stored.dtype) != target.dtype:
            problems.append(f"{weight} is {stored.dtype}{'' if has_scale else ' without a scale'}; the model "
                            f"holds it quantised as {target.dtype} + scale")
        elif held_scale is not None:
            rows = 1 if stacked else 0                           # one expert's part of the stack
            want = {weight: tuple(target.shape[rows:]), scale: tuple(held_scale.shape[rows:])}
            problems += [f"{n} is {_part_shape(ckpt, n, part)}, the model holds {shape}" for n, shape in want.items()
                         if _part_shape(ckpt, n, part) != shape]
    return problems


def _part_shape(ckpt: CheckpointDir, name: str, part: tuple[int, int] | None) -> tuple[int, ...]:
    shape = ckpt.spec(name).shape
    if part is None:
        return shape
    sliced = rank_slice(name, shape, *part)
    return shape[:sliced.dim] + (sliced.stop - sliced.start,) + shape[sliced.dim + 1:]


@dataclass(frozen=True)
class _Entry:
    """One module tensor: its stored weights (one per expert for a stack), their scales (None when
    unquantised), and this rank's cut of each — (rank, parts) for split tensors and Engram tables."""

    name: str
    sources: list[str]
    scales: list[str] | None
    part: tuple[int, int] | None
    every_expert: list[str]
    """The stored names of every rank's experts of a stack (all of them belong to this model)."""


def _cut(name: str, model: nn.Module) -> tuple[int, int] | None:
    """(TP rank, TP size) when tensor `name` is cut over the TP group (docs/CHECKPOINT.md §5)."""
    ctx = getattr(model, "parallel", None)
    if ctx is None or ctx.tp_size == 1 or shard_rule(name).kind not in (SPLIT, ENGRAM_ROWS):
        return None
    return ctx.tp_rank, ctx.tp_size


def _first_expert(name: str, model: nn.Module) -> tuple[int, int]:
    """(index of the stack's first expert, experts of every rank) for a stacked expert tensor."""
    moe = model.get_submodule(EXPERT_STACK.match(name)["prefix"].rpartition(".")[0])
    return moe.expert_range[0], moe.n_experts


def _plan(tensors: dict[str, torch.Tensor], ckpt: CheckpointDir, model: nn.Module):
    """An `_Entry` per module tensor; stored names it lacks; format problems."""
    plan, missing, problems = [], [], []
    for name, target in tensors.items():
        if _is_scale_of_quantized(name, tensors):
            continue
        stacked = is_expert_stack(name)
        n_stack, first, every = (target.shape[0], *_first_expert(name, model)) if stacked else (1, 0, 1)
        sources = stored_names(name, n_stack, first)
        scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        scales = stored_names(scale_name, n_stack, first) if scale_name else []
        part = _cut(name, model)
        absent = [s for s in sources if s not in ckpt]
        missing += absent
        if not absent:
            problems += _format_problems(ckpt, sources, scales, target, tensors.get(scale_name or ""), stacked, part)
        quantized = any(s in ckpt for s in scales)
        every_expert = stored_names(name, every) + (stored_names(scale_name, every) if quantized else []) if stacked else []
        plan.append(_Entry(name, sources, scales if quantized else None, part, every_expert))
    return plan, missing, problems


def _refuse(ckpt: CheckpointDir, what: str, names: list[str]) -> None:
    if names:
        raise CheckpointError(f"checkpoint at {ckpt.directory} {what}: "
                              f"{', '.join(names[:5])}{' …' if len(names) > 5 else ''}")


def load_into(model: nn.Module, ckpt: CheckpointDir, *, device: str | torch.device = "cpu",
              engram_on_disk: bool = False, progress: bool | None = None, huge_pages: bool = False) -> list[str]:
    """Materialise every module tensor of `model` (built on the meta device) from `ckpt`; on the CPU with
    `huge_pages`, each in its slot of one `WeightArena` (an Engram table left on disk stays mapped).

    Returns the stored names it left on disk (DSpark when not built, vision in a text-only build). Raises CheckpointError
    before touching the model if any module tensor has no stored source, or a stored weight is not in a
    form its module tensor can take (a quantised weight without its scale, a dtype the module does not
    hold quantised): those are never cast.
    """
    tensors = _module_tensors(model)
    plan, missing, problems = _plan(tensors, ckpt, model)
    _refuse(ckpt, f"lacks {len(missing)} tensor(s) the model needs", missing)
    _refuse(ckpt, f"stores {len(problems)} weight(s) in a form the model cannot take", problems)
    used = {s for e in plan for s in e.sources + (e.scales or [])}
    claimed = used | {s for e in plan for s in e.every_expert}          # other ranks' experts are the model's too
    left = [n for n in ckpt.names() if n not in used]
    stray = [n for n in left if n not in claimed and not skipped_family(n, model)]
    _refuse(ckpt, f"has {len(stray)} tensor(s) this model has no place for", stray)
    size = lambda e: sum(_part_bytes(ckpt, s, e.part) for s in e.sources + (e.scales or []))
    on_disk = lambda name: engram_on_disk and name.rpartition(".")[0].endswith(".engram.embed")
    arena = None
    if huge_pages and torch.device(device).type == "cpu":
        arena = WeightArena.of({name: t for name, t in tensors.items() if not on_disk(name)})
    with byte_progress(sum(map(size, plan)), "loading", enabled=progress) as bar:
        for entry in plan:
            _load_one(model, tensors, entry, ckpt, device, engram_on_disk, arena)
            bar.update(size(entry))
    return left


def _part_bytes(ckpt: CheckpointDir, name: str, part: tuple[int, int] | None) -> int:
    spec = ckpt.spec(name)
    return spec.nbytes * math.prod(_part_shape(ckpt, name, part)) // max(1, math.prod(spec.shape))


def _read(ckpt: CheckpointDir, names: list[str], stacked: bool, part: tuple[int, int] | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """One stored tensor (this rank's cut of it), or the per-expert tensors read straight into one stack;
    into `out` where it is given and has the stored shape and dtype (a weight arena's slot)."""
    if part is not None:
        cut = rank_slice(names[0], ckpt.spec(names[0]).shape, *part)
        return ckpt.tensor(names[0], slice_dim=cut.dim, start=cut.start, stop=cut.stop).clone()   # owned memory
    first = ckpt.spec(names[0])
    shape, dtype = ((len(names), *first.shape) if stacked else tuple(first.shape)), torch_dtype(first.dtype)
    if out is None or tuple(out.shape) != shape or out.dtype != dtype:
        out = torch.empty(shape, dtype=dtype)
    if not stacked:
        return ckpt.read(names[0], out=out)
    for e, name in enumerate(names):
        ckpt.read(name, out=out[e])
    return out


def _mapped(ckpt: CheckpointDir, name: str, part: tuple[int, int] | None) -> torch.Tensor:
    """A tensor (or this rank's rows of it) as a view of its file mapping, for sparse reads."""
    if part is None:
        return ckpt.tensor(name, random_access=True)
    cut = rank_slice(name, ckpt.spec(name).shape, *part)
    return ckpt.tensor(name, slice_dim=cut.dim, start=cut.start, stop=cut.stop, random_access=True)


def _load_one(model, tensors, entry: _Entry, ckpt, device, engram_on_disk, arena: WeightArena | None) -> None:
    name, sources, scales, part = entry.name, entry.sources, entry.scales, entry.part
    target = tensors[name]
    if engram_on_disk and name.endswith(".engram.embed.weight"):
        table = model.get_submodule(name[: -len(".weight")])
        table.attach(_mapped(ckpt, sources[0], part), _mapped(ckpt, scales[0], part), movable=False, read_only=True)
        return
    place = (lambda n, v: v) if arena is None else arena.place
    slot = (lambda n: None) if arena is None else arena.slot
    stacked = is_expert_stack(name)
    scale_name = name[: -len("weight")] + "scale"
    weight = _read(ckpt, sources, stacked, part, out=slot(name))
    scale = _read(ckpt, scales, stacked, part, out=slot(scale_name)) if scales else None
    if scale is not None and target.dtype == weight.dtype:
        set_module_tensor(model, scale_name, place(scale_name, scale.to(device)))
        value = weight.to(device)
    elif stacked and scale is not None:
        # dequantise expert by expert: the transient is one expert, not a second copy of the stack
        value = slot(name)
        if value is None:
            value = torch.empty(target.shape, dtype=target.dtype, device=device)
        for e in range(len(sources)):
            to_module_format(weight[e], scale[e], target, out=value[e])
        del weight, scale
    else:
        value = to_module_format(weight, scale, target, out=slot(name)).to(device)
    if tuple(value.shape) != tuple(target.shape):
        raise CheckpointError(f"{name}: stored tensors give shape {tuple(value.shape)}, the model holds "
                              f"{tuple(target.shape)}")
    set_module_tensor(model, name, place(name, value.contiguous()))


def load_model(path: str | Path, runtime: RuntimeConfig | None = None, *, device: str | None = None,
               engram_on_disk: bool = False, progress: bool | None = None, check_memory: bool = True,
               on_plan=None, parallel: ParallelContext | None = None):
    """Build a Transformer from a released-layout directory (config.json, index + shards, tokenizer.json).

    Everything that can be checked is checked before a tensor byte is read, in this order: the config,
    the shard headers against the layout the config implies, the context against the rope settings,
    the tokenizer against the vocabulary and the Engram key count, and the load plan against the memory
    available (`check_memory=False` skips the last; `on_plan(plan)` sees the plan first). The model is
    built on the meta device and each tensor is materialised once, from the memory map, in its final
    format. `engram_on_disk` keeps the Engram tables memory-mapped (only looked-up rows are ever read).
    The device is `device`, else `runtime.device`. With a `parallel` context each rank builds and reads
    only its part (docs/PARALLEL.md §1), after the sizes are checked against the config.
    """
    from ..model import Transformer

    path = Path(path)
    cfg = ModelConfig.from_json(path / "config.json")
    runtime = runtime or RuntimeConfig(device=device or "cpu")
    device = device or runtime.device
    parallel = parallel or ParallelContext()
    check_parallel_sizes(cfg, parallel.tp_size, parallel.ep_size)
    ckpt = CheckpointDir(path)
    ckpt.validate_against(released_inventory(cfg))
    check_context(cfg, runtime.max_seq_len)
    check_tokenizer(path, cfg)
    token_map = token_map_of(path, cfg)
    model = Transformer(cfg, runtime, device="meta", parallel=parallel)
    plan = plan_load(cfg, replace(runtime, device=str(device)), engram_on_disk=engram_on_disk,
                     model=None if parallel.distributed else model,       # the plan cuts a whole model itself
                     world_size=parallel.tp_size, ep_size=parallel.ep_size)
    if on_plan is not None:
        on_plan(plan)
    if check_memory:
        check_fits(cfg, replace(runtime, device=str(device)), plan)
    load_into(model, ckpt, device=device, engram_on_disk=engram_on_disk, progress=progress,
              huge_pages=runtime.huge_pages)
    model.to(device)                                  # the rotary frequencies; pinned Engram tables stay
    if token_map is not None:
        model.set_token_map(token_map.to(device))
    return model.eval()


def check_tokenizer(path: Path, cfg: ModelConfig) -> int | None:
    """The tokenizer's size when the directory has one; refused when it has ids the embedding lacks."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer
    try:
        size = Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception as e:                       # the Rust side raises plain Exceptions
        raise CheckpointError(f"{file}: not a readable tokenizers file ({e})") from None
    if size > cfg.vocab_size:
        raise CheckpointError(f"{path / 'tokenizer.json'} has {size:,} tokens; the config's vocab_size is "
                              f"{cfg.vocab_size:,}, so ids {cfg.vocab_size:,} … {size - 1:,} have no embedding row")
    return size


def token_map_of(path: Path, cfg: ModelConfig):
    """The Engram token map of the directory's tokenizer.json (None without Engram layers)."""
    if not cfg.engram_layer_ids:
        return None
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointError(f"{path}: the model has Engram layers, whose hash needs tokenizer.json, "
                              f"which the directory lacks")
    from ..model.engram import load_or_build_token_map
    return load_or_build_token_map(tokenizer, cfg.engram_compressed_vocab_size)


# -------------------------------------------------------------------------------------- saving
def stored_tensors(model: nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(stored name, tensor) for every tensor of the released layout the model holds, in layout order."""
    tensors = _module_tensors(model)
    inventory = released_inventory(cfg)
    for stored, spec in inventory.items():
        if skipped_family(stored, model) or (stored.endswith(".scale") and stored[:-5] + "weight" in inventory):
            continue                                         # scales are written with their weight
        module_name = module_name_of(stored)
        if module_name not in tensors:
            raise CheckpointError(f"the model has no tensor for {stored} (expected {module_name})")
        expert = PER_EXPERT.match(stored)
        pick = (lambda t: t[int(expert["expert"])]) if expert else (lambda t: t)
        value = pick(tensors[module_name].detach())
        scale_spec = inventory.get(stored[:-6] + "scale") if stored.endswith(".weight") else None
        held_scale = tensors.get(module_name[:-6] + "scale") if module_name.endswith(".weight") else None
        if held_scale is not None:
            if scale_spec is None:                   # re-casting code values would write garbage
                raise CheckpointError(f"{stored}: the model holds it quantised ({value.dtype} + scale); the "
                                      f"layout stores {spec.dtype} without a scale")
            weight, scale = value, pick(held_scale.detach())
        else:
            weight, scale = to_stored_format(value, spec, scale_spec)
        _check_stored(spec, weight)
        yield stored, weight.cpu().contiguous()
        if scale_spec is not None:
            yield scale_spec.name, scale.cpu().contiguous()


def _check_stored(spec: TensorSpec, weight: torch.Tensor) -> None:
    """What is written must be what the layout names: a mismatch means model and inventory disagree."""
    if weight.dtype != torch_dtype(spec.dtype) or tuple(weight.shape) != tuple(spec.shape):
        raise CheckpointError(f"{spec.name}: the model gives {weight.dtype} {tuple(weight.shape)}, the layout "
                              f"stores {spec.describe()}")


def save_model(model, directory: str | Path, *, tokenizer: str | Path | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, cfg: ModelConfig | None = None) -> Path:
    """Write config.json, the shards + index in the released layout, and the tokenizer files; `cfg`: the
    config to write under, when its storage formats differ from the model's (a trained fp32 model kept
    bf16), else the model's."""
    parallel = getattr(model, "parallel", None)
    if parallel is not None and (parallel.tp_size > 1 or parallel.ep_size > 1):
        # a rank holds a slice; the released layout stores whole tensors
        raise CheckpointError(f"save_model writes whole tensors; this model is the part of {parallel.describe()}: "
                              f"load the checkpoint in one process to save it")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = cfg or model.cfg
    save_checkpoint(directory, stored_tensors(model, cfg), max_shard_bytes=max_shard_bytes)
    (directory / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        source = Path(tokenizer)
        source_dir = source if source.is_dir() else source.parent
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_file() and (source_dir / name).resolve() != (directory / name).resolve():
                shutil.copyfile(source_dir / name, directory / name)
    return directory
