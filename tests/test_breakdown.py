"""The step-time breakdown's arithmetic (``engine/breakdown.py``): laps sum to the loop's wall
time, a forward is split along the slowest rank, the counter follows the sums; the worker's
phases (``worker.step_phases``). The real server's breakdown: tests/test_serve.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from xllm_eplb.engine.breakdown import StepBreakdown
from xllm_eplb.ipc.messages import ForwardOutput
from xllm_eplb.ipc.records import StepTimings
from xllm_eplb.worker.worker import step_phases


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _out(rank: int, phases: dict, wait: float = 0.0) -> ForwardOutput:
    return ForwardOutput(1, rank, timings=StepTimings(step_s=sum(phases.values()),
                                                      phases=phases, wait_s=wait, ring_s=0.001))


def test_laps_and_a_forward_split_along_the_slowest_rank():
    clk = Clock()
    b = StepBreakdown(2, clock=clk)
    clk.t = 1.0
    b.lap("idle")
    clk.t = 1.25
    b.lap("schedule")
    clk.t = 1.75                              # input written at 1.25, outputs held at 1.75
    b.forward([_out(0, {"experts": 0.1, "other": 0.1}, wait=0.2),
               _out(1, {"experts": 0.3, "dispatch": 0.1})])
    clk.t = 2.0
    b.lap("http")
    s = b.summary()
    assert s["steps"] == 1 and s["wall_s"] == 2.0
    assert s["seconds"] == {"idle": 1.0, "schedule": 0.25, "experts": 0.3, "dispatch": 0.1,
                            "ring": 0.5 - 0.4, "http": 0.25}
    assert abs(sum(s["fraction"].values()) - 1.0) < 1e-12
    assert s["per_rank"][0] == {"experts": 0.1, "other": 0.1, "wait": 0.2, "ring_io": 0.001}
    # a rank that reports more than the lap (clock granularity): scaled into it, no ring
    clk.t = 2.1
    b.forward([_out(0, {"experts": 0.2}), _out(1, {})])
    assert abs(b.summary()["seconds"]["experts"] - 0.4) < 1e-12
    reg = CollectorRegistry()
    c = Counter("phase_seconds", "x", ("phase",), registry=reg)
    b.export(c)
    b.export(c)                                # only the growth is added
    assert reg.get_sample_value("phase_seconds_total", {"phase": "idle"}) == 1.0
    b.reset()
    assert b.summary()["wall_s"] == 0.0 and b.summary()["per_rank"] == [{}, {}]


def test_worker_phases_fill_other_and_fall_back_to_the_moe_timings():
    ph = step_phases({"eplb_hooks": 0.01, "attention": 0.2, "experts": 0.3}, {}, 1.0)
    assert ph == {"eplb_hooks": 0.01, "attention": 0.2, "experts": 0.3, "other": 0.49}
    # a decoder without a timer: what its MoE timings say
    ph = step_phases({"eplb_hooks": 0.01}, {"expert_cpu_s": [0.1, 0.2], "comm_wait_s": 0.05,
                                            "moe_s": 0.5}, 1.0)
    assert ph["experts"] == 0.1 + 0.2 and ph["dispatch"] == 0.05
    assert abs(ph["moe_other"] - 0.15) < 1e-12 and abs(sum(ph.values()) - 1.0) < 1e-12


def test_all_to_all_rounds_and_the_mean_round_per_rank():
    """``all_to_all`` (issue #39): per rank the rounds of the EP all-to-all, per step and the
    mean round (the rank's seconds blocked on communication over its rounds)."""
    clk = Clock()
    b = StepBreakdown(2, clock=clk)

    def out(rank, rounds, comm):
        return ForwardOutput(1, rank, timings=StepTimings(step_s=0.01, a2a_rounds=rounds,
                                                          comm_s=comm))
    for step in range(2):
        clk.t = 0.1 * (step + 1)
        b.forward([out(0, 6, 0.003), out(1, 6, 0.0006)])
    a = b.summary()["all_to_all"]
    assert a[0] == {"rounds": 12, "comm_s": 0.006, "rounds_per_step": 6.0,
                    "round_us": 500.0}
    assert a[1]["rounds"] == 12 and abs(a[1]["round_us"] - 100.0) < 1e-9
    b.reset()
    assert b.summary()["all_to_all"] == [{"rounds": 0, "comm_s": 0.0, "rounds_per_step": 0.0,
                                          "round_us": 0.0}] * 2
