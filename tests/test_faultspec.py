"""Fault-injection specs: parsing rules, config/flag validation, and the worker-side hooks."""

from __future__ import annotations

import pytest

from xllm_eplb.errors import ConfigError
from xllm_eplb.faultspec import Fault, FaultSpecError, parse_fault
from xllm_eplb.flags import load_config
from xllm_eplb.worker.faults import NO_FAULTS, Faults, InjectedFault, make_faults


def test_parse_keys_and_defaults():
    f = parse_fault("prepare_delay:rank=1,layer=0,round=2,seconds=5")
    assert f == Fault("prepare_delay", rank=1, layer=0, round=2, seconds=5.0)
    assert parse_fault("corrupt_output") == Fault("corrupt_output")
    assert parse_fault("crash:phase=mid_transfer").phase == "mid_transfer"


@pytest.mark.parametrize("text, rule", [
    ("boom", "unknown fault kind 'boom'"),
    ("prepare_delay:rank=1", "prepare_delay needs seconds="),
    ("crash:phase=mid", "must be one of before_activate"),
    ("slow_step:rank=-1,seconds=1", "rank=-1 must be >= 0"),
    ("slow_step:step=0,seconds=1", "step=0 must be >= 1"),
    ("slow_step:seconds=nan", "must be a number in (0, 3600]"),
    ("p2p_fail:mode=maybe", "mode='maybe' must be one of raise, hang"),
    ("prepare_fail:seconds=1", "prepare_fail takes no key 'seconds'"),
    ("prepare_fail:rank", "must look like key=value"),
    ("prepare_fail:rank=1,rank=1", "given twice"),
])
def test_parse_errors_name_the_rule(text, rule):
    with pytest.raises(FaultSpecError, match=None) as e:
        parse_fault(text)
    assert rule in str(e.value)


def test_flags_are_repeatable_and_refused_without_the_switch():
    argv = ["--ep_size=2", "--enable_fault_injection=true",
            "--fault_inject=prepare_fail:rank=1", "--fault_inject", "slow_step:seconds=1"]
    cfg, src = load_config(argv)
    assert cfg.faults.fault_inject == ("prepare_fail:rank=1", "slow_step:seconds=1")
    assert src["fault_inject"] == "cli"
    with pytest.raises(ConfigError, match=r"^--fault_inject=prepare_fail:rank=1: needs "
                                          r"--enable_fault_injection=true$"):
        load_config(["--ep_size=2", "--fault_inject=prepare_fail:rank=1"])
    with pytest.raises(ConfigError, match=r"rank=2 must be < --ep_size=2"):
        load_config(["--ep_size=2", "--enable_fault_injection", "--fault_inject=crash:rank=2,"
                     "phase=mid_transfer"])
    with pytest.raises(ConfigError, match=r"layer=3 must be < 3"):
        load_config(["--ep_size=2", "--enable_fault_injection", "--fault_inject=prepare_fail:"
                     "layer=3"])


def test_disabled_is_the_null_object():
    cfg, _ = load_config(["--ep_size=2"])
    assert make_faults(cfg, 0, crash=lambda d: None) is NO_FAULTS
    cfg, _ = load_config(["--ep_size=2", "--enable_fault_injection",
                          "--fault_inject=prepare_fail:rank=1"])
    assert make_faults(cfg, 0, crash=lambda d: None) is NO_FAULTS     # not this rank
    assert isinstance(make_faults(cfg, 1, crash=lambda d: None), Faults)


def test_hooks_fire_deterministically_by_rank_layer_round_and_step():
    slept, crashed = [], []
    faults = [parse_fault(t) for t in ("prepare_delay:layer=1,round=2,seconds=3",
                                       "prepare_fail:layer=0,round=1",
                                       "crash:layer=2,round=1,phase=after_activate",
                                       "slow_step:step=7,seconds=0.5", "corrupt_output:step=9",
                                       "p2p_fail:rank=0,layer=1")]
    fx = Faults(faults, 1, crashed.append, sleep=slept.append)
    with pytest.raises(InjectedFault, match="prepare_fail layer=0 round=1"):
        fx.prepare(0)
    fx.prepare(0)                         # round 2 of layer 0: nothing
    fx.prepare(1)
    fx.prepare(1)                         # round 2 of layer 1: sleeps 3 s
    assert slept == [3.0]
    fx.before_activate(1)
    fx.p2p_wait(1)                        # p2p_fail is for rank 0 only
    fx.before_activate(2)
    fx.mid_transfer(2)
    assert crashed == []
    fx.after_activate(2)
    assert crashed == ["injected crash at phase=after_activate layer=2 round=1"]
    fx.step(6)
    fx.step(7)
    assert slept == [3.0, 0.5]
    assert [fx.corrupt(s) for s in (8, 9, 10)] == [False, True, False]
