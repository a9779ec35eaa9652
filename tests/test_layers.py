"""The package's layers: each imports only the layers below it, and no modules import each other in a circle.

model (plain torch) < data < training (Lightning/Hydra glue) < analysis (the measures, the report) < benchmarks
(pe-bench's protocols) < cli, as docs/ARCHITECTURE.md draws them; configs, offline, extras, settings (the torch-free
settings dataclasses) and files (the atomic writers) are leaves every layer may use; ``files`` imports the standard
library only. Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pe_geometry

PACKAGE_DIR = Path(pe_geometry.__file__).resolve().parent
PLUGIN_DIR = PACKAGE_DIR.parent / "hydra_plugins" / "pe_geometry"
LAYERS = {"configs": 0, "offline": 0, "extras": 0, "files": 0, "settings": 0,
          "model": 1, "data": 2, "training": 3, "analysis": 4, "benchmarks": 5, "cli": 6}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The layer of a ``pe_geometry`` module (None for the package root); hydra_plugins sits with the cli."""
    if module.startswith("hydra_plugins.pe_geometry"):
        return LAYERS["cli"]
    parts = module.split(".")
    if parts[0] != "pe_geometry" or len(parts) == 1:
        return None
    if parts[1] not in LAYERS:
        raise AssertionError(f"{module}: a top-level part of the package with no layer; add it to LAYERS")
    return LAYERS[parts[1]]


def imported_modules(path: Path) -> set[str]:
    """Every ``pe_geometry`` module this file imports (``from pkg import name`` counts as ``pkg.name`` when
    that is a module), at any depth of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package up
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names if known_module(f"{base}.{alias.name}")}
    return {m for m in found if m.startswith(("pe_geometry.", "hydra_plugins.pe_geometry")) and known_module(m)}


def known_module(name: str) -> bool:
    return name in MODULES


def source_files() -> list[Path]:
    return sorted([*PACKAGE_DIR.rglob("*.py"), *PLUGIN_DIR.rglob("*.py")])


MODULES = {module_name(p): p for p in source_files()}
GRAPH = {name: imported_modules(path) - {name} for name, path in MODULES.items()}


def test_the_layers_are_found():
    assert {layer_of(m) for m in MODULES} >= set(LAYERS.values())
    assert GRAPH["pe_geometry.training.pipeline"], "the import reader found nothing: the check would pass vacuously"


def test_no_module_imports_a_layer_above_its_own():
    """Every module at once: the failure lists each module that imports upward (one id, not one per module)."""
    upward = {}
    for module in sorted(MODULES):
        own = layer_of(module)
        if own is not None and (above := sorted(m for m in GRAPH[module] if (layer_of(m) or 0) > own)):
            upward[f"{module} (layer {own})"] = above
    assert len(MODULES) > 50 and not upward, f"modules that import from a layer above theirs: {upward}"


def top_level_imports(path: Path) -> set[str]:
    """The top-level package of every absolute import in a file, at any depth (``os.path`` -> ``os``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").partition(".")[0])
    return found


def test_the_leaf_modules_import_only_the_standard_library():
    for module in ("pe_geometry.files", "pe_geometry.offline"):
        outside = sorted(top_level_imports(MODULES[module]) - set(sys.stdlib_module_names) - {"__future__"})
        assert not outside, f"{module} imports {outside}: a leaf every layer imports must stay standard library only"


def test_no_modules_import_each_other_in_a_circle():
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not circles, f"modules that import each other in a circle: {circles}"
