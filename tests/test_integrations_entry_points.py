"""The entry points other engines discover (installed with the package): they load without
importing torch or a host engine, and do nothing unless XLLM_EPLB_POLICY is set."""

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
from importlib.metadata import entry_points
out = {}
for group in ("vllm.general_plugins", "sglang.srt.plugins"):
    eps = [e for e in entry_points(group=group) if e.name == "xllm_eplb"]
    out[group] = [e.value for e in eps]
    for e in eps:
        e.load()()
out["imported"] = sorted(m for m in ("torch", "vllm", "sglang") if m in sys.modules)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_entry_points_load_cheaply_and_do_nothing_without_env():
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLLM_EPLB_POLICY"}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["vllm.general_plugins"] == ["xllm_eplb.integrations.vllm:register"]
    assert got["sglang.srt.plugins"] == ["xllm_eplb.integrations.sglang:register"]
    assert got["imported"] == []
    assert r.stderr == ""
