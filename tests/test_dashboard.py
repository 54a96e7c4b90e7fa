"""The Grafana dashboard references only metrics the engine exports (scripts/check_dashboard.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_dashboard",
                                                  ROOT / "scripts" / "check_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_dashboard_passes(tmp_path):
    mod = _checker()
    assert mod.main([str(ROOT / "configs" / "grafana" / "xllm-eplb.json"),
                     "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and report["references"] >= 20


def test_unknown_metric_fails(tmp_path, capsys):
    mod = _checker()
    dash = json.loads((ROOT / "configs" / "grafana" / "xllm-eplb.json").read_text())
    dash["panels"][0]["targets"][0]["expr"] = "rate(xllm_eplb_no_such_metric_total[1m])"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dash))
    assert mod.main([str(bad)]) == 1
    assert "xllm_eplb_no_such_metric_total" in capsys.readouterr().err


def test_not_a_dashboard_is_an_error(tmp_path):
    mod = _checker()
    p = tmp_path / "x.json"
    p.write_text("[]")
    with pytest.raises(SystemExit, match="no 'panels'"):
        mod.main([str(p)])


def test_dashboard_shows_the_live_view():
    """#27: per-token latencies, queueing, step shape, KV-cache use and the hot experts with
    their replicas each have a panel."""
    dash = json.loads((ROOT / "configs" / "grafana" / "xllm-eplb.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for name in ("time_per_output_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "batch_size_sum", "tokens_per_step_sum",
                 "kv_cache_usage_ratio", "hot_expert_load_ratio", "hot_expert_replicas",
                 "hot_expert_id"):
        assert f"xllm_eplb_{name}" in exprs, name
