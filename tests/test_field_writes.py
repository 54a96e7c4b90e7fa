"""No module writes another object's fields (issue #42): a class's fields change only through its
own methods. Checked on the sources with the review's rule (``review_2026-12c``'s
``outside_writes.py``): every assignment (plain, augmented, annotated, tuple targets) to
``obj.attr`` where ``obj`` is a name other than ``self`` / ``cls``, and every ``self.x.attr = ...``
(a collaborator's field)."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "xllm_eplb"


def outside_writes(src: str) -> list[tuple[int, str]]:
    """``(line, "obj.attr")`` of every write into another object's field in ``src``."""
    rows = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        flat = [e for t in targets
                for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        for t in flat:
            if not isinstance(t, ast.Attribute):
                continue
            v = t.value
            if isinstance(v, ast.Name) and v.id not in ("self", "cls"):
                rows.append((node.lineno, f"{v.id}.{t.attr}"))
            elif (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name)
                  and v.value.id == "self"):
                rows.append((node.lineno, f"self.{v.attr}.{t.attr}"))
    return rows


def test_the_rule_sees_each_kind_of_write():
    src = ("a.x = 1\nb.y += 2\nc.z: int = 3\nd.u, e.v = 4, 5\nself.m.w = 6\n"
           "self.ok = 7\ncls.ok = 8\nlocal = 9\nself.m.call(10)\n")
    assert outside_writes(src) == [(1, "a.x"), (2, "b.y"), (3, "c.z"), (4, "d.u"), (4, "e.v"),
                                   (5, "self.m.w")]


def test_no_module_writes_another_objects_fields():
    found = [f"{p.relative_to(PKG.parent)}:{line} {what}"
             for p in sorted(PKG.rglob("*.py"))
             for line, what in outside_writes(p.read_text())]
    assert not found, "\n".join(found)
