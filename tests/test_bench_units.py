"""``xllm-eplb bench``'s arrival process (``--request-rate``, ``--burstiness``: gamma gaps, as
``vllm bench serve``), its table header and its argument errors; no server."""

from __future__ import annotations

import math

import numpy as np
import pytest
from click.testing import CliRunner

from xllm_eplb.commands.bench import arrival_times, bench, header_rows


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf).tolist() == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gaps_have_the_rate_and_the_gamma_shape(burstiness):
    """Mean gap 1/rate whatever the burstiness; coefficient of variation 1/sqrt(shape)
    (Poisson: 1)."""
    at = arrival_times(20001, 50.0, burstiness, seed=1)
    gaps = np.diff(at)
    assert at[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)
    assert arrival_times(10, 50.0, burstiness, seed=1).tolist() == at[:10].tolist()  # seeded


def test_header_shows_the_servers_workload_and_eplb_state():
    info = {"model": {"id": "xllm-eplb", "max_model_len": 2048},
            "status": {"enabled": True, "policy": "incremental", "placement_epoch": 3, "ep_size": 4,
                       "balancedness_mean": 0.81234,
                       "workload": {"kind": "synthetic", "rate_per_s": 8.0, "prompt_len": 32}}}
    rows = dict(header_rows("http://h:1", info, {"request_rate": 2.0, "burstiness": 0.5,
                                                 "concurrency": 16}))
    assert rows["Server workload"] == "synthetic rate_per_s=8.0 prompt_len=32"
    assert rows["EPLB"] == "on, policy=incremental, placement_epoch=3" and rows["EP size"] == "4"
    assert "Balancedness (mean, before)" not in rows     # in the EPLB section, beside the others
    assert (rows["Request rate (req/s)"], rows["Burstiness"]) == ("2", "0.5")
    rows = dict(header_rows("http://h:1", {}, {"request_rate": math.inf, "burstiness": 1.0,
                                               "concurrency": 1}))
    assert rows["Server state"].startswith("no /eplb/status")


@pytest.mark.parametrize("args, message", [
    (["--burstiness", "0.5"], "--burstiness=0.5: needs a finite --request-rate"),
    (["--request-rate", "0"], "Invalid value for '--request-rate'"),
    (["--burstiness", "-1", "--request-rate", "3"], "Invalid value for '--burstiness'"),
])
def test_bad_arrival_arguments_are_exit_2(args, message):
    r = CliRunner().invoke(bench, ["--url", "http://127.0.0.1:1", *args])
    assert r.exit_code == 2 and message in r.output, r.output


def _status(steps, crit, expert, forward, **kw):
    st = {"enabled": True, "ep_size": 4, "placement_epoch": 0, "slots_moved": 0,
          "critical_path": {"steps": steps, "critical_s": crit, "expert_cpu_s": expert,
                            "forward_cpu_s": forward}}
    st.update(kw)
    return st


def test_eplb_section_numbers_come_from_the_status_deltas():
    from xllm_eplb.commands.bench_eplb import eplb_notes, eplb_numbers, eplb_rows

    before = _status(10, 1.0, 2.0, 6.0, slots_moved=4)
    # 100 steps: slowest rank 3 ms/step, the 4 ranks 8 ms/step of expert time (2 ms each),
    # 40 ms/step of forward CPU over the 4 ranks (10 ms each: 8 ms other than experts)
    after = _status(110, 1.3, 2.8, 10.0, placement_epoch=3, slots_moved=10,
                    initial_balancedness_mean=0.6, balancedness_mean=0.9,
                    cost_model={"predicted_critical_s": 2.0, "predicted_critical_initial_s": 3.0},
                    cores={"cpus": 2, "processes": 5, "shared": True})
    n = eplb_numbers(before, after)
    assert n["steps"] == 100 and n["slots_moved_during_run"] == 6
    assert n["critical_s"] == pytest.approx(3e-3) and n["perfect_s"] == pytest.approx(2e-3)
    assert n["other_s"] == pytest.approx(8e-3)
    assert n["initial_s"] == pytest.approx(4.5e-3)        # 3 ms x (3.0 / 2.0), the cost model
    assert n["modelled_gain"] == pytest.approx(12.5 / 11 - 1)
    assert n["gain_over_perfect_left"] == pytest.approx(11 / 10 - 1)
    rows = dict(eplb_rows(n))
    assert rows["MoE critical path (ms/step)"] == "3.000"
    assert rows["Balancedness first/before/now"] == "0.6000, n/a, 0.9000"   # none reported before
    assert rows["Layers committed (total, run)"] == "0, 0"
    served = dict(eplb_rows(eplb_numbers({**before, "balancedness_mean": 0.7,
                                          "layers_committed": 2},
                                         {**after, "layers_committed": 5})))
    assert served["Balancedness first/before/now"] == "0.6000, 0.7000, 0.9000"
    assert served["Layers committed (total, run)"] == "5, 3"
    assert rows["Modelled tok/s gain vs initial"].startswith("+13.6%")
    assert "5 processes (EP ranks + engine) share 2 cores" in eplb_notes(n)[0]
    # EPLB off: the initial placement is the one served; no cost model needed
    off = eplb_numbers(_status(0, 0, 0, 0, enabled=False), _status(50, 0.2, 0.4, 1, enabled=False))
    assert off["initial_s"] == off["critical_s"] and off["modelled_gain"] == 0.0
    # committed, but the model is not fitted: no modelled figure rather than a wrong one
    unfit = eplb_numbers(before, _status(20, 1.1, 2.2, 7.0, placement_epoch=1))
    assert unfit["initial_s"] is None and "modelled_gain" not in unfit


def test_compare_alternates_and_reports_the_spread_of_the_pairs():
    from xllm_eplb.commands.bench_eplb import compare, compare_table

    calls = []

    def runner(name, tok):
        def run():
            calls.append(name)
            return {"tokens_per_s": tok.pop(0), "tpot_ms": 10.0, "ttft_ms": 5.0,
                    "critical_ms": 2.0 if name == "a" else 3.0, "perfect_ms": 1.5,
                    "imbalance": None, "balancedness": 0.9, "errors": 0,
                    "enabled": name == "a", "cores": {"shared": True}}
        return run

    rounds = compare(runner("a", [100.0, 110.0, 90.0]), runner("b", [100.0, 99.0, 99.0]), 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    text = compare_table("http://x:1", "http://y:2", rounds)
    tok = next(line for line in text.splitlines() if line.startswith("Output tok/s"))
    assert tok.split()[2:4] == ["100.0", "99.0"]                      # medians of A and B
    assert "-10.0% .. +10.0%" in tok and "A: http://x:1 (EPLB on)" in text
    crit = next(line for line in text.splitlines() if line.startswith("MoE critical path"))
    assert "+50.0% B worse" in crit and "lower" in crit and "n/a" in text
    assert "share cores" in text
    # every row says which direction is better; higher tok/s and lower TPOT are both "better"
    assert "+0.0% same" in tok and tok.rstrip().endswith("higher")
    bal = next(line for line in text.splitlines() if line.startswith("Balancedness (after)"))
    assert "+0.0% same" in bal


def test_compare_puts_the_critical_path_per_output_token():
    # issue 41 item 3: per step, the EPLB-off server looked faster (1.592 vs 1.783 ms): it
    # batched the same requests into fewer, larger steps
    from xllm_eplb.commands.bench_eplb import run_numbers

    res = {"tokens_per_s": 1.0, "tpot_mean_s": 0.01, "ttft_p50_s": 0.1, "errors": 0,
           "output_tokens": 200}
    before = _status(0, 0.0, 0.0, 0.0)
    few_big = run_numbers(res, before, _status(50, 0.1, 0.3, 1.0))     # 2 ms/step, 50 steps
    many_small = run_numbers(res, before, _status(100, 0.15, 0.4, 1.5))  # 1.5 ms/step, 100
    assert few_big["critical_ms"] == pytest.approx(0.5) and \
        many_small["critical_ms"] == pytest.approx(0.75)     # ms per output token
    assert run_numbers({**res, "output_tokens": 0}, before,
                       _status(50, 0.1, 0.3, 1.0))["critical_ms"] is None
