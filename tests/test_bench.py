"""``xllm-eplb bench`` against a real API server (uvicorn, reference model): every statistic
comes from streamed tokens; ShareGPT-format prompts; 200 concurrent streaming clients."""

from __future__ import annotations

import json

import pytest
from api_util import start_api
from click.testing import CliRunner

from xllm_eplb.commands.bench import bench, make_prompts, run_bench, sharegpt_prompts
from xllm_eplb.engine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    api, loop = start_api(ByteTokenizer(), max_batch_size=64)
    yield f"http://127.0.0.1:{api.port}"
    loop.stop.set()
    api.close()


def test_bench_streams_and_reports_every_latency(server, tmp_path):
    out = tmp_path / "b.json"
    r = CliRunner().invoke(bench, ["--url", server, "--requests", "6", "--concurrency", "3",
                                   "--max-tokens", "5", "--prompt-len", "8", "--json", str(out)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()           # the table: header, totals, latencies in ms
    assert "xllm-eplb bench" in lines[0] and f"Server:{' ' * 27}{server}" in lines
    assert "Model:                            tiny (max_model_len 96)" in lines
    assert "Server workload:                  unknown (the server does not report it)" in lines
    assert "Successful requests:              6" in lines and "Failed requests:                  0" in lines
    assert "Request rate (req/s):             inf" in lines
    row = next(ln for ln in lines if ln.startswith("TTFT"))
    res = json.loads(out.read_text())
    assert [float(x) for x in row.split()[1:]] == pytest.approx(
        [res[f"ttft_{s}_s"] * 1e3 for s in ("mean", "p50", "p90", "p99")], abs=0.01)
    assert res["request_rate"] == "inf" and res["server"]["model"]["id"] == "tiny"
    assert res["output_tokens"] == 30 and res["tokens_per_s"] > 0 and res["req_per_s"] > 0
    for k in ("ttft", "tpot", "itl", "e2e"):
        vals = [res[f"{k}_{s}_s"] for s in ("p50", "p90", "p99")]
        assert 0 < vals[0] <= vals[1] <= vals[2] and res[f"{k}_mean_s"] > 0
    assert res["ttft_p50_s"] < res["e2e_p50_s"]


def test_sharegpt_dataset_prompts(server, tmp_path):
    data = [{"conversations": [{"from": "human", "value": f"question {i}"},
                               {"from": "gpt", "value": "answer"}]} for i in range(3)]
    data.append({"conversations": [{"from": "human", "value": "x" * 1000}]})   # too long
    f = tmp_path / "sg.json"
    f.write_text(json.dumps(data))
    prompts = sharegpt_prompts(str(f), 5, 0, 400)
    assert len(prompts) == 5 and set(prompts) == {f"question {i}" for i in range(3)}
    res = run_bench(server, prompts, 3, 5)
    assert res["ok"] == 5 and all(len(o) == 3 for o in res["outputs"])
    f.write_text("[]")
    r = CliRunner().invoke(bench, ["--url", server, "--dataset", str(f)])
    assert r.exit_code == 2 and f"--dataset={f}: no conversation" in r.output


def test_200_concurrent_streaming_clients_all_complete(server):
    prompts = make_prompts(200, 6, 16, 1.2, 0)
    res = run_bench(server, prompts, 4, 200, timeout=120)
    assert res["ok"] == 200 and res["errors"] == 0, res["first_error"]
    assert all(len(o) == 4 for o in res["outputs"])
    # greedy: the same prompt gives the same tokens whatever batch it shared
    again = run_bench(server, prompts[:5], 4, 1)
    assert again["outputs"] == res["outputs"][:5]


def test_request_rate_spaces_the_arrivals(server):
    """--request-rate 8 with Poisson gaps: the run lasts at least the last arrival's offset,
    and the numbers say how it was driven."""
    from xllm_eplb.commands.bench import arrival_times

    prompts = make_prompts(8, 6, 16, 1.2, 0)
    res = run_bench(server, prompts, 3, 4, seed=3, request_rate=8.0, burstiness=1.0)
    last = arrival_times(8, 8.0, 1.0, 3)[-1]
    assert res["ok"] == 8 and last > 0.2 and res["seconds"] >= last
    assert (res["request_rate"], res["burstiness"], res["concurrency"]) == (8.0, 1.0, 4)
