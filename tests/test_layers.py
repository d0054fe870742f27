"""The layering of ``app/``: the kernels sit below everything else, and no import goes in a circle.

``app/kernels`` holds kernels only: they take tensors and numbers, never the engine's structures,
so they import nothing from the rest of ``app`` (what adapts the engine's batches, pools and graphs
to a kernel lives in ``app/engine``). And no module of ``app`` reaches itself through its imports:
a cycle makes import order matter and hides which module depends on which.

The graph is read from the source with ``ast``, not by importing, so that every import counts:
module-level ones, those inside functions (imported on demand) and those under
``if TYPE_CHECKING`` (a cycle of annotations is still a cycle of design). An import names the most
specific module of ``app`` it reaches: ``from app.engine import engine`` is an edge to
``app.engine.engine``, ``from app.engine import Engine`` one to the package ``app.engine``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP_ROOT = Path(__file__).resolve().parent.parent / "app"
KERNELS = "app.kernels"


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path`` in the package rooted at ``root``
    (``root/engine/kv_pool.py`` -> ``app.engine.kv_pool``, ``root/engine/__init__.py`` -> ``app.engine``)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_under(root: Path) -> dict[str, Path]:
    """Every module of the package rooted at ``root``, by dotted name."""
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _known_prefix(name: str, known: set[str]) -> str | None:
    """The longest dotted prefix of ``name`` that is one of ``known`` (None when there is none)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (its source at ``path``) imports, wherever in the
    file the import statement stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from base import name``: the submodule base.name where there is one, else base.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            reached = _known_prefix(target, known)
            if reached is not None and reached != module:
                found.add(reached)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package rooted at ``root`` -> the package's modules it imports."""
    modules = modules_under(root)
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as the path ``[a, b, ..., a]``, or None when it has none
    (a depth-first walk without recursion; modules in sorted order, so the answer is stable)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt in done or nxt not in graph:
                continue
            path.append(nxt)
            on_path.add(nxt)
            stack.append(iter(sorted(graph[nxt])))
    return None


def test_kernels_import_nothing_from_the_rest_of_app():
    graph = import_graph(APP_ROOT)
    kernels = {name for name in graph if name == KERNELS or name.startswith(KERNELS + ".")}
    assert len(kernels) > 10, f"expected the kernel modules under {APP_ROOT / 'kernels'}, found {sorted(kernels)}"
    upward = {name: sorted(target for target in graph[name] if target not in kernels) for name in sorted(kernels)}
    upward = {name: targets for name, targets in upward.items() if targets}
    assert upward == {}, f"kernels import modules above them (move the adapter to app/engine): {upward}"


def test_app_has_no_import_cycle():
    graph = import_graph(APP_ROOT)
    assert len(graph) > 50
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def test_the_graph_counts_imports_in_functions_under_type_checking_and_relative(tmp_path):
    root = _write_package(tmp_path / "app", {
        "__init__.py": "",
        "low.py": "import math\n",
        "top.py": "def f():\n    from app import low\n    return low\n",
        "sub/__init__.py": "from .leaf import X\n",
        "sub/leaf.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from ..top import f\n"
            "X = 1\n"
        ),
        "sub/user.py": "import app.sub\nfrom .. import low\nfrom app.sub import X\n",
    })
    assert import_graph(root) == {
        "app": set(),
        "app.low": set(),
        "app.top": {"app.low"},
        "app.sub": {"app.sub.leaf"},
        "app.sub.leaf": {"app.top"},
        "app.sub.user": {"app.sub", "app.low"},
    }


def test_find_cycle_names_the_cycle_through_a_function_level_import(tmp_path):
    root = _write_package(tmp_path / "app", {
        "__init__.py": "",
        "a.py": "from app.b import g\n",
        "b.py": "def g():\n    from app.c import h\n    return h\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.a import g\n",
        "d.py": "import app.a\n",
    })
    graph = import_graph(root)
    assert find_cycle(graph) == ["app.a", "app.b", "app.c", "app.a"]
    del graph["app.c"]
    assert find_cycle(graph) is None
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": set(), "w": {"x", "z"}}) is None
    assert find_cycle({"x": {"x"}}) == ["x", "x"]
