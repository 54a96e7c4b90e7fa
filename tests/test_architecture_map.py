"""docs/architecture.md's module map matches the tree: every module of ``xllm_eplb/`` is named in
the map's first column (``pkg/mod.py``, or a bare ``mod.py`` after ``pkg/`` in the same cell, or
``pkg/*.py``), every module named there exists, and every call its contract column names
(``f(...)``, ``mod.f(...)``, ``Class.m(...)``) is defined where the row says."""
import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "xllm_eplb"


def map_names() -> set[str]:
    """Module paths (relative to ``xllm_eplb/``) named in the module map's first column;
    ``pkg/*`` for a whole package."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Module map and contracts", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        pkg = ""
        for tok in re.findall(r"`([^`]+)`", line[2:].split(" | ")[0]):
            if tok.endswith("/*.py"):
                pkg = tok[:-4]
                names.add(pkg + "*")
            elif tok.endswith("/"):
                pkg = tok
            elif tok.endswith(".py"):
                if "/" in tok:
                    pkg = tok.rsplit("/", 1)[0] + "/"
                    names.add(tok)
                else:
                    names.add(pkg + tok)
    return names


def test_every_module_is_in_the_map_and_every_mapped_module_exists():
    names = map_names()
    tree = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if p.name != "__init__.py"}
    missing = sorted(m for m in tree
                     if m not in names and m.rsplit("/", 1)[0] + "/*" not in names)
    stale = sorted(n for n in names if not n.endswith("*") and n not in tree)
    assert not missing, f"modules missing from docs/architecture.md's module map: {missing}"
    assert not stale, f"docs/architecture.md's module map names modules that do not exist: {stale}"
    assert len(tree) > 100    # the walk found the package


#: words of the contracts' formulas and parameter names that read like calls, not API
NOT_API = {"exp", "ceil", "writer"}


def _rows() -> list[tuple[str, list[Path], str]]:
    """(first cell, the row's module files, contract cell) per module-map row; a package the
    row names (``pkg/``) adds its ``__init__.py``, and all its files when the row names none of
    them."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Module map and contracts", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = line[2:].split(" | ")
        pkg, mods, pkgs = "", [], set()
        for tok in re.findall(r"`([^`]+)`", cells[0]):
            if tok.endswith("/*.py"):
                pkg = tok[:-4]
                pkgs.add(pkg)
            elif tok.endswith("/"):
                pkg = tok
                pkgs.add(pkg)
            elif tok.endswith(".py"):
                pkg = tok.rsplit("/", 1)[0] + "/" if "/" in tok else pkg
                mods.append(PKG / (tok if "/" in tok else pkg + tok))
        for d in (PKG / p for p in pkgs):
            if d.is_dir():
                named = [m for m in mods if m.parent == d]
                mods += [d / "__init__.py"] if named else sorted(d.glob("*.py"))
        rows.append((cells[0], [m for m in mods if m.is_file()], cells[-1]))
    return rows


@functools.cache
def _file_names(p: Path) -> tuple[frozenset[str], dict[str, set[str]]]:
    """Top-level names (functions, classes, assignments, imports) of module ``p`` and the
    members (methods, fields) of every class it defines."""
    top: set[str] = set()
    members: dict[str, set[str]] = {}
    tree = ast.parse(p.read_text())
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(n.name)
        elif isinstance(n, ast.Assign):
            top |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            top.add(n.target.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            top |= {(a.asname or a.name).split(".")[0] for a in n.names}
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):
            m = members.setdefault(n.name, set())
            for b in ast.walk(n):
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    m.add(b.name)
                elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                    m.add(b.target.id)
                elif isinstance(b, ast.Attribute) and isinstance(b.ctx, ast.Store):
                    m.add(b.attr)
    return frozenset(top), members


def _names(paths) -> tuple[set[str], dict[str, set[str]]]:
    """:func:`_file_names` of several modules together."""
    top: set[str] = set()
    members: dict[str, set[str]] = {}
    for p in paths:
        t, m = _file_names(p)
        top |= t
        for k, v in m.items():
            members.setdefault(k, set()).update(v)
    return top, members


def test_every_function_a_contract_names_exists():
    """Each call the contract column writes resolves: ``f(...)`` is defined in the row's own
    modules (or is a method of a class they define; a call into another module is written
    ``mod.f(...)`` or ``Class.m(...)``); ``mod.f(...)`` is defined in module ``mod`` (one of the
    row's, else any of that name, or ``mod`` is a variable and ``f`` a method); ``Class.m(...)``
    is a member of that class anywhere in the package; ``obj.m(...)`` is a method of some class
    of the package. Names of formulas and parameters (``NOT_API``) are skipped."""
    everything = list(PKG.rglob("*.py"))
    _, all_members = _names(everything)
    by_module: dict[str, list[Path]] = {}
    for p in everything:
        if p.name != "__init__.py":
            by_module.setdefault(p.stem, []).append(p)
    methods = set().union(*all_members.values())
    bad = []
    for first, mods, contract in _rows():
        top, members = _names(mods)
        own_methods = set().union(set(), *members.values())
        own = {m.stem: m for m in mods if m.name != "__init__.py"}
        for code in re.findall(r"`([^`]+)`", contract):
            for m in re.finditer(r"(?<![\w.])([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?\(", code):
                a, b = m.groups()
                if b is None:
                    ok = a in top or a in own_methods or a in NOT_API
                elif a in own:
                    ok = b in _file_names(own[a])[0]
                elif a in by_module:        # another module, or a variable of that name
                    ok = any(b in _file_names(p)[0] for p in by_module[a]) or b in methods
                elif a in top and a not in members:      # an imported module (``time.time``)
                    ok = True
                elif a in all_members:
                    ok = b in all_members[a]
                else:
                    ok = b in methods
                if not ok:
                    bad.append(f"{first.split(' ')[0]}: {code[:70]}")
    assert not bad, "docs/architecture.md's module map names calls that do not exist:\n" + \
        "\n".join(bad)
