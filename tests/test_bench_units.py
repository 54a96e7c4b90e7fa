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
            "status": {"enabled": True, "policy": "incremental", "generation": 3, "ep_size": 4,
                       "balancedness_mean": 0.81234,
                       "workload": {"kind": "synthetic", "rate_per_s": 8.0, "prompt_len": 32}}}
    rows = dict(header_rows("http://h:1", info, {"request_rate": 2.0, "burstiness": 0.5,
                                                 "concurrency": 16}))
    assert rows["Server workload"] == "synthetic rate_per_s=8.0 prompt_len=32"
    assert rows["EPLB"] == "on, policy=incremental, generation=3" and rows["EP size"] == "4"
    assert rows["Balancedness (mean, before)"] == "0.8123"
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
