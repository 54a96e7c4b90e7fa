"""The arithmetic behind the elastic acceptance numbers in docs/benchmarks.md
(``xllm_eplb/testing/elastic_measure.py``, used by ``scripts/bench_elastic.py``): log lines
matched to kills, coverage, rates around a kill, the stream verdicts. Pure functions, real log lines as
the engine and launcher write them (``obs/logs.py`` formatter): no processes."""

from __future__ import annotations

import time

import numpy as np
import pytest

from xllm_eplb.testing import elastic_measure as M


def _line(t: float, msg: str, level: str = "WARNING", tag: str = "engine") -> str:
    lt = time.localtime(t)
    return (f"{time.strftime('%Y-%m-%dT%H:%M:%S', lt)}.{int(round(t % 1 * 1000)) % 1000:03d} "
            f"{level} {tag} {msg}")


def test_stamp_reads_the_formatter_local_time_to_the_millisecond():
    t = 1_764_675_000.25
    assert M.stamp(_line(t, "x")) == pytest.approx(t, abs=1e-3)


def test_kills_are_matched_to_the_lines_that_follow_them(tmp_path):
    run = tmp_path / "logs" / "run1"
    run.mkdir(parents=True)
    (tmp_path / "logs" / "latest").symlink_to("run1")
    k1, k2 = 1_764_675_000.0, 1_764_675_010.0
    (run / "launcher.log").write_text("\n".join([
        _line(k1 + 0.004, "EPLB elastic detect proc=ep2 pid=1 pg_generation=2 mode=shrink"),
        _line(k2 + 0.006, "EPLB elastic detect proc=ep0 pid=2 pg_generation=3 mode=shrink")]))
    (run / "engine.log").write_text("\n".join([
        _line(k1 + 0.020, "EPLB elastic detect rank=2 worker=ep2 step=9 detect_s=0.016"),
        _line(k1 + 0.300, "EPLB elastic resume rank=2 mode=shrink fence_s=0.01 reform_s=0.07 "
                          "seconds=0.28 requests_reprefilled=12 requests_kept=30"),
        _line(k2 + 0.030, "EPLB elastic detect rank=0 worker=ep0 step=40 detect_s=0.024")]))
    (run / "rank1.log").write_text(_line(k1 + 0.2, "EPLB elastic resharded rank=1 canary=ok",
                                         "INFO", "rank1"))
    lines = M.elastic_lines(tmp_path / "logs")
    assert len(lines["resharded"]) == 1 and not lines["canary_failed"]
    rows = M.per_kill(lines, [k1, k2])
    assert rows[0]["launcher_s"] == pytest.approx(0.004, abs=2e-3)
    assert rows[0]["detect_s"] == pytest.approx(0.020, abs=2e-3)
    assert rows[0]["resume_s"] == pytest.approx(0.300, abs=2e-3)
    assert rows[0]["reform_s"] == 0.07 and rows[0]["reprefilled"] == 12
    assert rows[0]["kept"] == 30
    # the second kill has its own detect line and no resume yet (never the first kill's)
    assert rows[1]["detect_s"] == pytest.approx(0.030, abs=2e-3) and rows[1]["resume_s"] is None


def test_coverage_names_the_layers_that_miss_an_expert():
    assert M.coverage_gaps([[0, 1, 2, 3], [0, 1, 1, 3]], 4) == [1]
    assert M.coverage_gaps([[3, 2, 1, 0, -1]], 4) == []


def test_rate_after_a_kill_and_when_it_reaches_the_target():
    # 100 tok/s for 8 s, a 1.5 s pause after the kill, then 70 tok/s
    before = np.arange(-8.0, 0.0, 0.01)
    after = np.arange(1.5, 10.0, 1 / 70)
    got = M.after_kill(np.concatenate([before, after]) + 100.0, 100.0, 8.0, 0.675)
    assert got["before_tok_s"] == pytest.approx(100, rel=0.01)
    assert got["after_ratio"] == pytest.approx(0.70, rel=0.02)
    assert 3.0 <= got["reach_s"] <= 4.0          # the first full 2 s window at >= 67.5 tok/s
    assert M.after_kill(before + 100.0, 100.0, 8.0, 0.675)["reach_s"] is None


def test_stream_verdicts_and_percentiles():
    ref = [5, 6, 7, 8]
    assert M.token_faults([5, 6, 7, 8], ref) == ""
    assert M.token_faults([5, 6, 6, 7, 8], ref) == "duplicated"
    assert M.token_faults([5, 7, 8], ref) == "skipped"
    assert M.token_faults([5, 6], ref) == "truncated"
    assert M.token_faults([5, 6, 9, 8], ref) == "changed"
    p = M.pct([0.1, 0.2, None, float("nan"), 0.3], 50, 99)
    assert p["n"] == 3 and p["p50"] == 0.2 and p["max"] == 0.3
