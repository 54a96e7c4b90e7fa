"""`serve` with no EPLB flags: incremental EPLB on, cost-aware, no built-in workload unless
asked; with the demo workload the console, /eplb/status and `xllm-eplb bench` say so."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from xllm_eplb.commands.bench import workload_warning


def _status(url: str) -> dict:
    with urllib.request.urlopen(url + "/eplb/status", timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_defaults_run_incremental_eplb_and_the_demo_workload_is_announced(start_server):
    # no config file, no EPLB flag: only the rank count and the demo workload
    s = start_server("--workload=synthetic", "--workload_rate=4", "--workload_output_len=8",
                     base=["--ep-size", "2"])
    s.wait_ready(180)
    out = s.out.read_text().splitlines()
    i = next(j for j, ln in enumerate(out) if ln.startswith("xllm-eplb ready"))
    assert out[i + 1] == ("note: the built-in synthetic workload is on (4 req/s of demo traffic "
                          "share the engine with your requests; --workload=none turns it off)")
    st = _status(s.url)
    assert st["enabled"] is True and st["policy"] == "incremental"
    assert (st["workload"]["kind"], st["workload"]["rate_per_s"]) == ("synthetic", 4.0)
    assert "cost_model" in st and st["layers_regressed"] == 0
    warn = workload_warning(st)
    assert warn is not None and warn.startswith("warning: the server runs the built-in "
                                                "synthetic workload (4.0 req/s)")
    # the demo traffic feeds the cost model: pure-decode steps with the workers' timings
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _status(s.url)["cost_model"]["observed_steps"]:
        time.sleep(1)
    assert _status(s.url)["cost_model"]["observed_steps"] > 0
    assert workload_warning({}) is None           # another engine (no workload field): no warning
    assert workload_warning({"workload": {"kind": "none"}}) is None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_default_flags_commit_a_layer_within_a_minute_of_skewed_traffic(start_server):
    # issue 41 item 2: xLLM's eplb_update_interval default (1000 s) alone kept EPLB idle for
    # 17 minutes; the first round runs after --eplb_first_round_samples steps of traffic
    from xllm_eplb.commands.bench import make_prompts, run_bench

    s = start_server("--workload=none", base=["--ep-size", "4"])
    s.wait_ready(180)
    out = s.out.read_text().splitlines()
    i = next(j for j, ln in enumerate(out) if ln.startswith("xllm-eplb ready"))
    assert out[i + 1].startswith("note: EPLB (incremental) runs its first round after 256 load "
                                 "samples"), out
    st = _status(s.url)
    assert st["placement_epoch"] == 0 and st["next_round"].startswith(
        "after 256 load samples (0 so far"), st["next_round"]
    prompts = make_prompts(32, 32, 16, 1.2, 0)          # bench's default skewed topic prompts
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60 and _status(s.url)["placement_epoch"] == 0:
        res = run_bench(s.url, prompts, 32, 16, timeout=60)
        assert res["errors"] == 0, res
    took = time.monotonic() - t0
    st = _status(s.url)
    assert st["layers_committed"] > 0 and took < 60, (took, st["next_round"], st["rounds"])
    # once the first round has ended (a round moves its layers one at a time, at decode steps:
    # traffic keeps it going), the interval paces the next one
    end = time.monotonic() + 60
    while st["next_round"] == "when the round in flight ends" and time.monotonic() < end:
        assert run_bench(s.url, prompts[:8], 8, 16, timeout=60)["errors"] == 0
        st = _status(s.url)
    assert st["rounds"] >= 1 and "--eplb_update_interval" in st["next_round"], st["next_round"]
