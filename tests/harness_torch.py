"""Whether a test is about torch, and the plan's view of sys.modules for one that is not
(conftest.py's torch_only_where_the_test_uses_it).

A loader planned over a dataset (DatasetSpec.torch) has every reader import torch where the
trainer imported it, so that torch's generator is seeded per sample as in torch's workers:
one to three seconds per reader start. In a test worker torch is imported as soon as any
torch test module is collected, so every dataset test paid it, though a script of that test
(and the test run alone) never imports torch."""

from __future__ import annotations

import ast
import collections.abc
import functools
import inspect
import sys

_TORCH = ("torch", "shmloader.torch")


def _is_torch(module: str | None) -> bool:
    return module is not None and any(module == name or module.startswith(name + ".") for name in _TORCH)


@functools.lru_cache(maxsize=None)
def module_imports_torch(path: str) -> bool:
    """True where the module's top level (not a function's or class's body; a try or if
    there counts) imports torch or shmloader.torch, or calls importorskip("torch")."""
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read(), path)
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Import) and any(_is_torch(alias.name) for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (_is_torch(node.module) or node.module == "shmloader"
                                                 and any(alias.name == "torch" for alias in node.names)):
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args \
                and isinstance(node.args[0], ast.Constant) and _is_torch(node.args[0].value):
            return True
        pending.extend(ast.iter_child_nodes(node))
    return False


def uses_torch(function, module) -> bool:
    """The module imports torch at its top level, or the test's own source names it (an
    import, a call of a helper named for it, a docstring about it): conservative, so that
    only tests that never touch torch are told it is absent."""
    if module_imports_torch(module.__file__):
        return True
    try:
        return "torch" in inspect.getsource(function)
    except (OSError, TypeError):
        return True


class _ModulesWithoutTorch(collections.abc.Mapping):
    """sys.modules as a process that never imported torch sees it."""

    def __getitem__(self, name: str):
        if _is_torch(name):
            raise KeyError(name)
        return sys.modules[name]

    def __iter__(self):
        return (name for name in list(sys.modules) if not _is_torch(name))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class SysWithoutTorch:
    """The sys module, but for its modules: those of a process without torch."""

    modules = _ModulesWithoutTorch()

    def __getattr__(self, name: str):
        return getattr(sys, name)
