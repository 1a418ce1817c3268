"""`dsv41 inspect`: parameter accounting, component descriptions and browsable pages for a config.

`inspect_model(config_or_dir)` reads a config (a config.json, a checkpoint directory holding one, or a
ModelConfig) and needs no weights: the figures come from the checkpoint inventory the config implies,
and the module classes from a meta-device build of the model. `main(argv)` is the command line,
`dsv41 inspect CONFIG_OR_DIR [--json] [--html DIR]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import ConfigError, ModelConfig
from .accounting import Accounting, Figure, GroupRow
from .components import ComponentKind, describe_components
from .html import write_html
from .locations import build_meta_model, locate, module_refs
from .report import Report, render_text, to_dict

__all__ = ["Accounting", "ComponentKind", "Figure", "GroupRow", "Report", "inspect_model", "main", "render_text",
           "to_dict", "write_html"]


def _load(config_or_dir: str | Path | ModelConfig) -> tuple[ModelConfig, str]:
    if isinstance(config_or_dir, ModelConfig):
        return config_or_dir, "ModelConfig"
    path = Path(config_or_dir)
    return ModelConfig.from_json(path), str(path / "config.json" if path.is_dir() else path)


def inspect_model(config_or_dir: str | Path | ModelConfig) -> Report:
    cfg, source = _load(config_or_dir)
    accounting = Accounting(cfg)
    components = describe_components(cfg, accounting.roles)
    code = {key: tuple(locate(ref) for ref in kind.code) for key, kind in components.items()}
    prefixes = [node.prefix for _, node in accounting.tree.walk() if node.prefix]
    modules = module_refs(build_meta_model(cfg), prefixes)
    return Report(source, cfg, accounting, components, code, modules)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41 inspect",
                                description="Parameter accounting and component pages of a DeepSeek-V4.1 config "
                                            "(no weights are read).")
    p.add_argument("config", metavar="CONFIG_OR_DIR", help="config.json, or a checkpoint directory holding one")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON report instead of text")
    p.add_argument("--html", metavar="DIR", help="also write index.html and one page per component kind to DIR")
    return p


def check_weights(path: Path) -> str | None:
    """For a directory that holds weights: None if they match the config's layout, else why not.

    Only headers are read. A directory with a config and no weights is a config, not a broken checkpoint."""
    from ..checkpoint.inventory import released_inventory
    from ..checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, CheckpointDir
    from ..errors import UserError
    if not path.is_dir() or not ((path / INDEX_NAME).is_file() or (path / SINGLE_NAME).is_file()):
        return None
    try:
        CheckpointDir(path).validate_against(released_inventory(ModelConfig.from_json(path / "config.json")))
    except UserError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        report = inspect_model(args.config)
    except ConfigError as e:
        print(f"dsv41 inspect: {e}", file=sys.stderr)
        return 2
    broken = check_weights(Path(args.config))
    if broken is not None:
        print(f"dsv41 inspect: {args.config} is not a usable checkpoint: {broken}", file=sys.stderr)
        return 2
    if args.html:
        pages = write_html(report, args.html)
        print(f"dsv41 inspect: wrote {len(pages)} pages to {args.html} (open index.html)", file=sys.stderr)
    sys.stdout.write(json.dumps(to_dict(report), indent=1) + "\n" if args.json else render_text(report))
    return 0
