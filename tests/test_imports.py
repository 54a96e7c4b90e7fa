"""The package's import graph: acyclic, and no layer imports a layer above it.

The graph is built with ``ast`` from the source files, top-level and function-level imports
alike (a lazy import still ties the modules together). The layer order is the one documented in
docs/architecture.md ("Layers"); packages in the same layer are peers and never import each other.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PKG = "xllm_eplb"
ROOT = Path(__file__).resolve().parents[1] / PKG

#: top to bottom; a module may import its own package's modules and anything in a lower layer
LAYERS = [
    ("commands", "__main__"),
    ("cli",),
    ("node",),
    ("launcher", "testing"),
    ("preflight",),
    ("engine", "worker"),
    ("elastic",),
    ("ipc",),
    ("model", "sim", "integrations"),
    ("eplb", "kernels"),
    ("obs",),
    ("flags",),
    ("config",),
    ("child", "errors", "faultspec", "__init__"),
]
RANK = {name: i for i, group in enumerate(LAYERS) for name in group}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _targets(node: ast.AST, here: str, is_pkg: bool, known: set[str]) -> list[str]:
    """The package modules one import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PKG]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = here.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if is_pkg else 0)]
        base = ".".join(anchor + ([base] if base else []))
    if base.split(".")[0] != PKG:
        return []
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    return subs if len(subs) == len(node.names) else subs + [base]


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source)."""
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_pkg = path.name == "__init__.py"
        deps = {t for node in ast.walk(tree) for t in _targets(node, name, is_pkg, known)}
        graph[name] = {d for d in deps if d in known and d != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a module path (first module repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_graph_sees_top_level_and_function_level_imports():
    g = import_graph()
    assert "xllm_eplb.config" in g["xllm_eplb.flags"]                 # top level
    assert "xllm_eplb.launcher" in g["xllm_eplb.commands.serve"]      # inside the command
    assert "xllm_eplb.eplb.placement" in g["xllm_eplb.model.validate"]  # from pkg import module


def test_cycle_finder_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
    missing = sorted({_layer(m) for m in _modules()} - set(RANK))
    assert not missing, f"add {missing} to LAYERS here and in docs/architecture.md"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_upward_or_sideways_import(module):
    here = _layer(module)
    bad = [d for d in sorted(import_graph()[module])
           if _layer(d) != here and RANK[_layer(d)] <= RANK[here]]
    assert not bad, (f"{module} (layer {here!r}) imports {bad}: only lower layers "
                     f"({[g for g in LAYERS[RANK[here] + 1:]]}) may be imported")


def test_layer_order_is_documented():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    for group in LAYERS:
        assert " ".join(f"`{n}`" for n in group) in doc, group


#: code that runs every forward step: an import there costs a dict lookup per call and hides a
#: dependency from a reader
PER_STEP = {"xllm_eplb.engine.engine": ("Engine.step", "Engine.prepare", "Engine.send",
                                        "Engine.finish", "Engine.plan_ahead", "Engine._get"),
            "xllm_eplb.worker.worker": ("Worker.step", "Worker._forward", "Worker.next_input"),
            "xllm_eplb.worker.executor": ("EplbExecutor.before_forward",
                                          "EplbExecutor.after_forward")}


def _function(tree: ast.Module, dotted: str) -> ast.FunctionDef:
    cls, name = dotted.split(".")
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("module", sorted(PER_STEP))
def test_per_step_code_imports_nothing(module):
    tree = ast.parse(_modules()[module].read_text())
    for dotted in PER_STEP[module]:
        fn = _function(tree, dotted)
        imports = [n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not imports, f"{module}.{dotted} imports at lines {imports}"

