"""Black-box outcome of every injected fault (issue #17) on a real `xllm-eplb serve --model`
at EP2: real processes, real shared memory, real gloo; observed only through the logs,
``/eplb/status``, ``/metrics`` and exit codes. Each server is killed and its /dev/shm objects
swept even on failure (``start_server``). Completed requests must give the fault-free greedy
tokens.

- Faults the run survives (one shared server): ``prepare_delay`` beyond the prepare timeout,
  ``prepare_fail``, ``p2p_delay``, ``slow_step``.
- Faults that stop the run (one server each): ``crash`` at each phase, ``p2p_fail`` (raise and
  hang), ``corrupt_output``. The chosen P2P outcome: the run stops cleanly; the engine never
  commits the layer and no forward ever runs on a partially switched placement.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
from fault_util import (
    Traffic,
    activations,
    flags,
    get_json,
    log_lines,
    metric,
    outcome,
    reference_tokens,
    scrape,
    wait_for,
)

from xllm_eplb.testing.serving import shm_objects

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shm")]


@pytest.fixture(scope="module")
def ref(ds8_ckpt):
    return reference_tokens(ds8_ckpt)


def _first(path: Path, needle: str, after: float = 0.0) -> float | None:
    hits = [t for t, _ in log_lines(path, needle) if t >= after]
    return hits[0] if hits else None


def _stop_clean(s) -> None:
    s.note_children()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(15) == 0, s.err.read_text()[-2000:]
    time.sleep(0.3)
    assert s.alive() == [] and shm_objects(s.run_id) == []


@pytest.mark.timeout(400)
def test_survivable_faults_roll_back_and_serving_continues(start_server, ds8_ckpt, ref):
    # NOTE: the delay (5 s) exceeds the budget (1.5 s) even when the 1.5 s slow step below lands
    # in the same window and stalls the engine's timeout check (seen on CI with 3 s)
    specs = ["prepare_delay:rank=1,layer=0,round=1,seconds=5",
             # windows to freeze in (the test takes the first it sees open, see below)
             *[f"prepare_delay:rank=1,layer=0,round={r},seconds=1" for r in range(3, 8)],
             "prepare_fail:rank=0,layer=1,round=1",
             "p2p_delay:rank=1,layer=2,round=1,seconds=1",
             "slow_step:rank=0,step=40,seconds=1.5"]
    s = start_server(*flags(ds8_ckpt, "--eplb_prepare_timeout_seconds=1.5",
                            "--eplb_heartbeat_seconds=1",
                            *[f"--fault_inject={x}" for x in specs]))
    s.wait_ready(240)
    traffic = Traffic(s.url)
    eng, r0, r1 = (s.log_dir / n for n in ("engine.log", "rank0.log", "rank1.log"))
    try:
        def settled():
            t0 = _first(eng, "EPLB layer 0 prepare progress timed out") or \
                _first(eng, "EPLB layer 0 output timed out")
            t1 = _first(eng, "EPLB layer 1 prepare progress timed out") or \
                _first(eng, "EPLB layer 1 output timed out")
            if t0 is None or t1 is None:
                return None
            again = _first(eng, "EPLB layer activated layer=0", after=t0)
            p2p = _first(r1, "fault injected kind=p2p_delay")
            slow = _first(r0, "fault injected kind=slow_step")
            failed_hb = _first(r0, "tasks_failed_since_last=1")
            if None in (again, p2p, slow, failed_hb):
                return None
            return t0, t1, again
        t_to0, t_to1, t_again = wait_for(settled, 120, "timeouts, recoveries and every fault", s)
        t_freeze, t_thaw, t_late = _freeze_mid_prepare(s, eng, r1)
        st = get_json(s.url + "/eplb/status")
        assert st["layers_timed_out"] >= 2 and st["stale_tokens"] >= 1, st
        # every activation moves the placement epoch; a rollback's restore is no commit
        assert st["layers_committed"] >= 2, st
        assert (st["layers_committed"] <= st["placement_epoch"]
                <= st["layers_committed"] + st["layers_rolled_back"]), st
        assert metric(s.url, "xllm_eplb_rebalance_layers_total", result="timed_out") >= 2
        assert metric(s.url, "xllm_eplb_rebalance_layers_total", result="committed") >= 2
        # the slow step is visible in the step-time histogram: a step above 1 s
        one = scrape(s.url)                 # both from one scrape: steps go on meanwhile
        n_all = metric(s.url, "xllm_eplb_step_duration_seconds_count", text=one)
        n_fast = metric(s.url, "xllm_eplb_step_duration_seconds_bucket", le="1.0", text=one)
        assert n_all > n_fast, (n_all, n_fast)
        assert get_json(s.url + "/health")["status"] == "serving"
    finally:
        traffic.stop()
    ok, failed = traffic.check(ref)
    assert ok >= 3 and failed == 0, traffic.results
    _stop_clean(s)
    # prepare_delay: rank 1's token of layer 0 came after the deadline and was ignored
    t_delay = _first(r1, "fault injected kind=prepare_delay")
    assert "EPLB ignoring stale prepare token" in eng.read_text()
    # prepare_fail: never reported ready, counted by the executor's heartbeat
    r0_text = r0.read_text()
    assert "prepare_expert_weight failed layer=1" in r0_text
    assert "InjectedFault: injected prepare_fail layer=1 round=1" in r0_text
    t_fail = _first(r0, "fault injected kind=prepare_fail")
    # no rank ever ran a layer the engine did not commit, every rank ran every commit
    commits, per_rank = activations(s.log_dir, 2)
    assert commits and all(rk == commits for rk in per_rank), (commits, per_rank)
    t_p2p = _first(r1, "fault injected kind=p2p_delay")
    t_p2p_done = _first(eng, "EPLB layer activated layer=2", after=t_p2p)
    assert t_p2p_done is not None
    outcome("prepare_delay", detect_s=t_to0 - t_delay, recover_s=t_again - t_to0,
            requests_failed=failed)
    outcome("rank_frozen_mid_prepare", frozen_s=t_thaw - t_freeze,
            detect_after_thaw_s=t_late - t_thaw, requests_failed=failed)
    outcome("prepare_fail", detect_s=t_to1 - t_fail,
            recover_s=(_first(eng, "EPLB layer activated", after=t_to1) or t_to1) - t_to1,
            requests_failed=failed)
    outcome("p2p_delay", commit_after_s=t_p2p_done - t_p2p, requests_failed=failed)
    outcome("slow_step", requests_failed=failed, requests_ok=ok)


def _freeze_mid_prepare(s, eng: Path, r1: Path) -> tuple[float, float, float]:
    """The issue's scenario: SIGSTOP rank 1 while its prepare of layer 0 (a 1 s delay inside
    the 1.5 s budget, rounds 3-7) is pending. The frozen rank blocks the forward too, so no
    tick runs; its token comes in the output that ends the freeze, past the deadline: the layer
    must time out there (not commit), and the next round must commit again. The window taken is
    one opened less than 0.4 s ago (a loaded machine may see a round's line too late: that
    prepare has finished, and the next round's window is taken)."""
    worker = next(p for p in psutil.Process(s.proc.pid).children()
                  if "ep1" in " ".join(p.cmdline()))

    def open_window():
        now = time.time()
        return [t for t, ln in log_lines(r1, "fault injected kind=prepare_delay rank=1 layer=0")
                if "seconds=1 " in ln and now - t < 0.4]
    wait_for(open_window, 90, "a delayed prepare of layer 0 on rank 1 (rounds 3-7)", s)
    t_freeze = time.time()
    worker.suspend()
    try:
        time.sleep(4.0)
    finally:
        worker.resume()
    t_thaw = time.time()

    def after_thaw():
        late = sorted((t, ln) for needle in ("EPLB layer 0 ", "EPLB layer activated layer=0 ")
                      for t, ln in log_lines(eng, needle) if t >= t_freeze)
        return late[0] if late else None
    t_late, line = wait_for(after_thaw, 30, "layer 0's fate after the freeze", s)
    assert "timed out" in line, f"layer 0 committed a late prepare: {line}"
    wait_for(lambda: _first(eng, "EPLB layer activated", after=t_late), 60,
             "a commit after the late token", s)
    return t_freeze, t_thaw, t_late


FATAL = {
    "crash_before_activate": (["crash:rank=1,round=1,phase=before_activate"],
                              ["rank 1", "phase=before_activate", "exit code 86"]),
    # on the shared-memory transport (issue #39): the survivor's failed round is no cause
    "crash_mid_transfer": (["crash:rank=1,round=1,phase=mid_transfer", "--ep_transport=shm"],
                           ["rank 1", "phase=mid_transfer", "exit code 86"]),
    "crash_after_activate": (["crash:rank=1,round=1,phase=after_activate"],
                             ["rank 1", "phase=after_activate", "exit code 86"]),
    "p2p_fail": (["p2p_fail:rank=1,round=1"], ["rank 1", "injected p2p_fail"]),
    "p2p_hang": (["p2p_fail:rank=1,round=1,mode=hang", "--worker_timeout_seconds=3"],
                 ["rank 1", "stopped answering", "--worker_timeout_seconds=3"]),
    "corrupt_output": (["corrupt_output:rank=1,step=30"],
                       ["rank 1", "ring /xllm_eplb_", "_out1: bad frame", "checksum mismatch"]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(FATAL))
def test_fatal_fault_stops_the_run_cleanly_naming_the_rank(case, start_server, ds8_ckpt, ref):
    specs, words = FATAL[case]
    extra = [x if x.startswith("--") else f"--fault_inject={x}" for x in specs]
    # --elastic_ep=false: a crash stops the run (with it on, the worker would be replaced)
    s = start_server(*flags(ds8_ckpt, *extra, "--elastic_ep=false"))
    s.wait_ready(240)
    traffic = Traffic(s.url)
    fired = s.log_dir / "rank1.log"
    try:
        wait_for(lambda: s.proc.poll() is not None, 120, f"{case}: the run to stop")
        t_exit = time.time()
    finally:
        traffic.stop()
    rc, err = s.proc.returncode, s.err.read_text()
    t_fault = _first(fired, "fault injected")
    assert t_fault is not None, f"{case}: the fault never fired: {err[-2000:]}"
    limit = 10.0 + (3.0 if case == "p2p_hang" else 0.0)
    assert rc != 0 and t_exit - t_fault < limit, (rc, t_exit - t_fault)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # nothing half-activated was ever committed: the fault hit the run's first activation
    if case != "corrupt_output":
        assert "EPLB layer activated" not in (s.log_dir / "engine.log").read_text()
    time.sleep(0.5)
    assert s.alive() == [] and shm_objects(s.run_id) == []
    ok, in_flight = traffic.check(ref, until=t_fault)
    _, failed = traffic.check(ref, until=t_exit)
    outcome(case, detect_and_exit_s=t_exit - t_fault, exit_code=rc, requests_ok=ok,
            failed_in_flight=in_flight, refused_until_exit=failed - in_flight)
