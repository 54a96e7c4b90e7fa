"""Dispatch mode resolution (``enable_fused_mc2`` x ``expert_parallel_degree`` x pure decode) as a
table, and the precondition fallback."""

from __future__ import annotations

import logging

import pytest

from xllm_eplb.config import Config, EplbConfig
from xllm_eplb.model.dispatch import (
    FUSED,
    PLAIN,
    CommStats,
    _timed,
    fused_precondition_failure,
    resolve_dispatch_mode,
    resolve_fused_setting,
)

# (expert_parallel_degree, enable_fused_mc2, pure_decode, precondition failure) -> (mode, fallback?)
TABLE = [
    (0, -1, False, None, PLAIN, False),
    (0, -1, True, None, PLAIN, False),
    (1, -1, True, None, PLAIN, False),
    (2, -1, False, None, FUSED, False),      # auto -> 1 with EP level 2
    (2, -1, True, "x", PLAIN, True),
    (0, 0, True, None, PLAIN, False),
    (2, 0, True, None, PLAIN, False),
    (0, 1, False, None, FUSED, False),
    (0, 1, True, None, FUSED, False),
    (0, 1, False, "x", PLAIN, True),
    (0, 2, True, None, FUSED, False),
    (0, 2, False, None, PLAIN, False),       # mixed step: plain, not a fallback
    (2, 2, False, "x", PLAIN, False),
    (0, 2, True, "x", PLAIN, True),
]


@pytest.mark.parametrize("epd,mc2,pure,fail,mode,fallback", TABLE)
def test_resolution_table(epd, mc2, pure, fail, mode, fallback):
    got, why = resolve_dispatch_mode(epd, mc2, pure_decode=pure, precondition_failure=fail)
    assert got == mode
    assert (why is not None) == fallback


def test_auto_setting_and_bad_value():
    assert [resolve_fused_setting(d, -1) for d in (0, 1, 2)] == [0, 0, 1]
    assert [resolve_fused_setting(0, v) for v in (0, 1, 2)] == [0, 1, 2]
    with pytest.raises(ValueError, match="enable_fused_mc2=5"):
        resolve_fused_setting(0, 5)


def test_preconditions():
    assert fused_precondition_failure("cpu", "float32", False) is None
    assert fused_precondition_failure("cpu", "float32", True) is None   # no graphs on cpu
    assert "graph" in fused_precondition_failure("cuda", "float32", True)
    assert "bfloat16" in fused_precondition_failure("cuda", "bfloat16", False, bf16_supported=False)
    assert fused_precondition_failure("cuda", "bfloat16", False, bf16_supported=True) is None


def test_fallback_logged_once(caplog):
    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.model.default_checkpoint import with_default_checkpoint

    cfg = with_default_checkpoint(Config(eplb=EplbConfig(ep_size=2, enable_fused_mc2=1)))
    m = Decoder.reference(cfg)
    assert m.dispatch_mode(pure_decode=True) == FUSED
    m.fused_failure = "bfloat16 unsupported on device=cuda"   # what a device without bf16 reports
    with caplog.at_level(logging.WARNING):
        assert m.dispatch_mode(pure_decode=True) == PLAIN
        assert m.dispatch_mode(pure_decode=False) == PLAIN
    lines = [r.getMessage() for r in caplog.records if "dispatch fallback" in r.getMessage()]
    assert len(lines) == 1 and "requested=fused used=plain" in lines[0]


def test_comm_stats_count_each_blocking_call():
    st = CommStats()
    st.count_wait(0.25)
    assert _timed(st, lambda: 7) == 7                   # a timed call counts as one more
    assert st.calls == 2 and 0.25 <= st.wait_s < 0.25 + 1.0 and st.extra == {}
