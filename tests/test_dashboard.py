"""The Grafana dashboard references only metrics the engine exports: ``scripts/check_dashboard.py``
run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_dashboard.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_shipped_dashboard_passes(tmp_path):
    r = _check(str(ROOT / "configs" / "grafana" / "xllm-eplb.json"),
               "--json", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and report["references"] >= 20


def test_unknown_metric_fails(tmp_path):
    dash = json.loads((ROOT / "configs" / "grafana" / "xllm-eplb.json").read_text())
    dash["panels"][0]["targets"][0]["expr"] = "rate(xllm_eplb_no_such_metric_total[1m])"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dash))
    r = _check(str(bad))
    assert r.returncode == 1
    assert "xllm_eplb_no_such_metric_total" in r.stderr


def test_not_a_dashboard_is_an_error(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[]")
    r = _check(str(p))
    assert r.returncode == 2 and "no 'panels'" in r.stderr


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
