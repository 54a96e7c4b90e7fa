"""The HTTP API fuzzed with schemathesis against the OpenAPI schema the server publishes
(``/openapi.json``), on a real `xllm-eplb serve --model` at EP2 with EPLB on (issue #17): no
generated request (valid or not) may get a 5xx, and the server keeps serving afterwards.

Bounded here (a few cases per operation); the long run (docs/benchmarks.md)::

    .venv/bin/xllm-eplb serve --ep-size 2 --model DIR --workload=none --port 8000 &
    .venv/bin/schemathesis run http://127.0.0.1:8000/openapi.json --checks not_a_server_error \\
        --max-examples 200 --seed 17 --request-timeout 120
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fault_util import get_json, metric, post

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shm")]


def schemathesis_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "schemathesis"
    found = str(exe) if exe.exists() else shutil.which("schemathesis")
    if found is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]'")
    return [found]


def run_schemathesis(url: str, max_examples: int, seed: int, timeout: float):
    """-> (return code, output, test cases generated)."""
    r = subprocess.run([*schemathesis_cmd(), "run", f"{url}/openapi.json", "--checks",
                        "not_a_server_error", "--max-examples", str(max_examples), "--seed",
                        str(seed), "--request-timeout", "120", "--no-color", "--workers", "1",
                        "--generation-database", "none", "--phases",
                        "examples,coverage,fuzzing"],
                       capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    m = re.search(r"(\d+) generated", out)
    return r.returncode, out, int(m.group(1)) if m else 0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from xllm_eplb.model.checkpoint import make_checkpoint

    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("fuzz_ckpt") / "c",
                           num_experts=8, top_k=2)


@pytest.mark.timeout(600)
def test_fuzzed_requests_never_get_a_5xx_and_the_server_stays_up(start_server, ckpt):
    s = start_server("--ep-size", "2", "--model", str(ckpt), "--workload=none",
                     "--max_position_embeddings=128", "--max_prefill_tokens=64")
    s.wait_ready(240)
    rc, out, cases = run_schemathesis(s.url, max_examples=8, seed=17, timeout=420)
    print(f"fuzz-outcome kind=http_api cases={cases} rc={rc}", flush=True)
    assert rc == 0, out[-4000:]
    assert cases >= 20, out[-2000:]          # the schema's operations were really exercised
    assert s.proc.poll() is None and get_json(s.url + "/health")["status"] == "serving"
    code, body = post(s.url, {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.0})
    assert code == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert metric(s.url, "xllm_eplb_requests_total") >= 1
