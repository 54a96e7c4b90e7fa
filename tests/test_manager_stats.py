"""The manager's records (eplb/manager_stats.py): each event it reports is one named method,
and the record adds it up (issue 42: no module writes another class's fields)."""

from __future__ import annotations

import logging
from dataclasses import asdict

import pytest

from xllm_eplb.eplb.manager_stats import Counters, Heartbeats


def test_counters_add_up_each_event_the_manager_reports():
    c = Counters()
    c.count_round(3, 0.25)
    c.count_round(2, 0.5)
    c.count_commit(True, 4, 2)
    c.count_commit(False, 1, 1)                 # a rollback's restore moves slots, no commit
    for fresh in (True, True, False):
        c.count_sample(fresh)
    c.count_rejected()
    c.count_stale_token()
    c.count_stale_token()
    c.count_backlog_drop()
    c.count_timeout()
    assert asdict(c) == asdict(Counters(
        rounds=2, layers_published=5, last_policy_seconds=0.5, layers_committed=1,
        slots_moved=5, weight_copies=3, samples=2, samples_stale=1, samples_rejected=1,
        stale_tokens=2, samples_backlog_dropped=1, layers_timed_out=1))


def test_heartbeat_lines_count_samples_and_layers_since_the_last_line(caplog):
    hb = Heartbeats(0.0, 1.0, "greedy")
    hb.count_sample()
    hb.count_sample()
    hb.count_round(3)
    hb.manager_call(0.5)
    with caplog.at_level(logging.INFO):
        hb.loop_pass(0.5, 0.1, 0.002)           # within the period: no line
        assert "rebalance_thread" not in caplog.text
        hb.loop_pass(1.0, 0.2, 0.002)
        assert ("EPLB heartbeat rebalance_thread policy=greedy batches_since_last=2 "
                "layers_updated_since_last=3 last_rebalance_ms=2\n") in caplog.text
        caplog.clear()
        hb.count_sample()
        hb.loop_pass(2.0, 0.0, 0.0)
        assert "batches_since_last=1 layers_updated_since_last=0" in caplog.text
    old = Heartbeats(0.0, 1.0, "greedy")
    old.loop_pass(0.0, 0.5, 0.0)
    hb.inherit(old)                             # a replacing manager keeps the policy CPU
    assert hb.stats() == {"heartbeat_at": 2.0, "manager_heartbeat_at": 0.5,
                          "policy_cpu_seconds": pytest.approx(0.8)}
