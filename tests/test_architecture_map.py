"""docs/architecture.md's module map matches the tree: every module of ``xllm_eplb/`` is named in
the map's first column (``pkg/mod.py``, or a bare ``mod.py`` after ``pkg/`` in the same cell, or
``pkg/*.py``), and every module named there exists."""
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
