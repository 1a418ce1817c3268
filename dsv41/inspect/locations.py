"""Where a component lives in dsv41: source files and line ranges, and the module the model builds.

Code references are "module:qualname" strings (components.py); they resolve by import, so a renamed
class or function fails loudly in the tests. Module classes per checkpoint prefix come from a
meta-device build of the model: no memory is allocated and no weight is read.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..config import ModelConfig, RuntimeConfig

_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class CodeLocation:
    ref: str
    path: str
    first_line: int
    last_line: int

    @property
    def name(self) -> str:
        return self.ref.partition(":")[2]

    def __str__(self) -> str:
        return f"{self.path} {self.first_line}–{self.last_line} · {self.name}"


def _resolve(ref: str):
    module_name, _, qualname = ref.partition(":")
    obj = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj


def _display_path(source: str) -> str:
    path = Path(source).resolve()
    try:
        return path.relative_to(_PACKAGE_PARENT).as_posix()
    except ValueError:
        return path.as_posix()


def locate(ref: str) -> CodeLocation:
    obj = _resolve(ref)
    lines, first = inspect.getsourcelines(obj)
    return CodeLocation(ref, _display_path(inspect.getsourcefile(obj)), first, first + len(lines) - 1)


def class_ref(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}:{cls.__qualname__}"


def build_meta_model(cfg: ModelConfig) -> nn.Module:
    from ..model import Transformer

    return Transformer(cfg, RuntimeConfig(), device="meta")


def module_refs(model: nn.Module, prefixes: Iterable[str]) -> dict[str, str]:
    """Checkpoint prefix → dsv41 class of the module the model holds there (absent when unbuilt; plain
    torch containers are left out)."""
    found = {}
    for prefix in prefixes:
        try:
            ref = class_ref(model.get_submodule(prefix))
        except AttributeError:
            continue
        if ref.startswith("dsv41."):
            found[prefix] = ref
    return found
