"""`dsv41 check DIR`: validate a checkpoint directory without loading it, and print its load plans.

Reads the config, the index and every shard header (never a tensor's data), so the released 475 GiB
directory is checked in seconds and a few hundred MiB. Every problem found is collected, not just the
first: the layout against the config (names, dtypes, shapes), shard sizes against their headers, the
index's `total_size` against the tensors it maps, the tokenizer against `vocab_size` and the Engram key
count, and the world sizes the config allows. The plans (plan.py) cover world sizes 1, 2, 4 and 8 in both
numerics, with Engram in memory and on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import ModelConfig, RuntimeConfig
from ..errors import CheckpointError, UserError
from .inventory import released_inventory
from .plan import check_context, context_limit, fmt_bytes, meta_model, plan_load
from .safetensors_io import CheckpointDir
from .sharding import allowed_world_sizes

PLAN_WORLD_SIZES = (1, 2, 4, 8)


@dataclass
class CheckReport:
    directory: Path
    facts: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _try(report: CheckReport, what, *args):
    try:
        return what(*args)
    except UserError as e:
        report.problems.append(str(e))
        return None


def check_directory(path: str | Path, *, context: int = 4096, batch: int = 1) -> CheckReport:
    """Everything `dsv41 check` reports on `path`; reads headers only."""
    path = Path(path)
    report = CheckReport(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory" if path.exists() else f"{path} does not exist")
    cfg = ModelConfig.from_json(path / "config.json")          # nothing else means anything without it
    ckpt = _try(report, CheckpointDir, path)
    if ckpt is not None:
        files = len({ckpt.file_of(n) for n in ckpt.names()})
        report.facts.append(f"{len(ckpt):,} tensors, {fmt_bytes(ckpt.total_bytes)} in {files} file(s); every header "
                            f"read, no shard truncated")
        _try(report, ckpt.validate_against, released_inventory(cfg))
        declared = ckpt.index_metadata.get("total_size")
        if declared is not None and int(declared) != ckpt.total_bytes:
            report.problems.append(f"the index's total_size is {int(declared):,} bytes; its tensors hold "
                                   f"{ckpt.total_bytes:,} bytes")
    _check_tokenizer(report, path, cfg)
    limit = context_limit(cfg)
    report.facts.append("context limit " + (f"{limit:,} (original_seq_len {cfg.original_seq_len:,} × rope_factor "
                                            f"{cfg.rope_factor:g})" if limit else "none stated (plain RoPE)"))
    allowed = allowed_world_sizes(cfg)
    report.facts.append(f"world sizes the config divides: {', '.join(map(str, allowed[:12]))}"
                        + (" …" if len(allowed) > 12 else ""))
    if limit is not None:
        context = min(context, limit)
    _try(report, check_context, cfg, context)
    report.plans = plan_table(cfg, [ws for ws in PLAN_WORLD_SIZES if ws in allowed], context=context, batch=batch)
    return report


def _check_tokenizer(report: CheckReport, path: Path, cfg: ModelConfig) -> None:
    from .model_io import check_tokenizer, token_map_of
    if not (path / "tokenizer.json").is_file():
        report.problems.append(f"{path} has no tokenizer.json (the prompt encoder and the Engram hash need it)")
        return
    size = _try(report, check_tokenizer, path, cfg)
    if size is not None:
        report.facts.append(f"tokenizer: {size:,} tokens (vocab_size {cfg.vocab_size:,})")
    if cfg.engram_layer_ids and _try(report, token_map_of, path, cfg) is not None:
        report.facts.append(f"Engram token map: {cfg.engram_compressed_vocab_size:,} keys, as the config says")


def plan_table(cfg: ModelConfig, world_sizes, *, context: int, batch: int) -> list[str]:
    """One line per (world size, numerics): bytes per rank with Engram in memory and on disk."""
    lines = [f"load plans per rank (context {context:,}, batch {batch}; weights + caches + peak transient):",
             f"  {'ranks':>5}  {'numerics':<9}  {'Engram in memory':>16}  {'Engram on disk':>14}  "
             f"{'of which caches':>15}"]
    inventory = released_inventory(cfg)
    for numerics in ("reference", "fast"):
        runtime = RuntimeConfig(numerics=numerics, max_seq_len=context, max_batch_size=batch, dtype="bfloat16")
        model = meta_model(cfg, runtime)
        for ws in world_sizes:
            held = plan_load(cfg, runtime, world_size=ws, model=model, inventory=inventory)
            mapped = plan_load(cfg, runtime, world_size=ws, engram_on_disk=True, model=model,
                               inventory=inventory)
            lines.append(f"  {ws:>5}  {numerics:<9}  {fmt_bytes(held.on_device):>16}  {fmt_bytes(mapped.on_device):>14}"
                         f"  {fmt_bytes(held.cache):>15}")
    return lines


def render(report: CheckReport) -> str:
    verdict = (f"{report.directory}: OK, the directory matches the layout its config implies" if report.ok else
               f"{report.directory}: {len(report.problems)} problem(s)")
    out = [verdict] + [f"  {f}" for f in report.facts]
    for problem in report.problems:
        first, *rest = problem.splitlines() or [""]
        out += [f"  problem: {first}"] + [f"    {line.strip()}" for line in rest]
    return "\n".join(out + [""] + report.plans) + "\n"
