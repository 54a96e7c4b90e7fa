#!/usr/bin/env python3
"""Check a Grafana dashboard against the metrics the engine really exports.

Every ``xllm_eplb_*`` name in any panel target, annotation or template query must be a sample
name :class:`xllm_eplb.obs.metrics.EngineMetrics` can expose (``_total``, ``_bucket``, ``_sum``,
``_count`` included; per-layer series counted as existing). Exit 0 when all are known, 1 with
one line per unknown name (and where it is used), 2 when the file is not a dashboard.

    python scripts/check_dashboard.py [configs/grafana/xllm-eplb.json] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / "configs" / "grafana" / "xllm-eplb.json"
NAME_RE = re.compile(r"\bxllm_eplb_[A-Za-z0-9_]+")
QUERY_KEYS = ("expr", "query", "definition")


def exported_names() -> set[str]:
    """Every sample/family name of the engine's registry (per-layer and per-expert series
    on)."""
    from xllm_eplb.obs.metrics import EngineMetrics, metric_names

    return metric_names(EngineMetrics(4, 3, per_layer=True, hot_experts=4,
                                      all_experts=True).registry)


def queries(node, where: str = "") -> list[tuple[str, str]]:
    """(location, query text) of every query string in the dashboard tree."""
    out: list[tuple[str, str]] = []
    if isinstance(node, dict):
        title = node.get("title") or node.get("name") or where
        for k, v in node.items():
            if k in QUERY_KEYS and isinstance(v, str):
                out.append((str(title), v))
            else:
                out += queries(v, str(title))
    elif isinstance(node, list):
        for item in node:
            out += queries(item, where)
    return out


def _not_a_dashboard(why: str) -> None:
    print(f"error: {why}", file=sys.stderr)
    raise SystemExit(2)


def check(path: Path) -> tuple[list[str], int]:
    """(problems, number of metric references) for the dashboard at ``path``."""
    try:
        dash = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        _not_a_dashboard(f"{path}: not a readable JSON dashboard ({e})")
    if not isinstance(dash, dict) or not isinstance(dash.get("panels"), list):
        _not_a_dashboard(f"{path}: no 'panels' list (not a Grafana dashboard)")
    known = exported_names()
    problems, refs = [], 0
    for where, q in queries(dash):
        for name in NAME_RE.findall(q):
            refs += 1
            if name not in known:
                problems.append(f"{path.name}: panel {where!r}: unknown metric {name}")
    for p in dash["panels"]:
        if p.get("type") != "row" and not p.get("targets"):
            problems.append(f"{path.name}: panel {p.get('title')!r}: no targets")
    if refs == 0:
        problems.append(f"{path.name}: references no xllm_eplb_ metric")
    return problems, refs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dashboard", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--json", type=Path, help="write {ok, references, problems} here")
    ap.add_argument("--quick", action="store_true", help="accepted for script uniformity")
    args = ap.parse_args(argv)
    problems, refs = check(args.dashboard)
    if args.json:
        args.json.write_text(json.dumps({"ok": not problems, "references": refs,
                                         "problems": problems}, indent=2))
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{args.dashboard}: ok ({refs} metric references)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
