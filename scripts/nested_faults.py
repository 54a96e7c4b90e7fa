"""Nested faults in rejoin mode (issue #23 item 9): each scenario on its own
``xllm-eplb serve --ep-size 4 --elastic_ep=true`` (generated deepseek_v3, 8 experts, top-2,
float64, EPLB off), with 8 concurrent streams running through the faults, every stream compared
with a fault-free reference. Each must end **recovered** (back at 4 ranks, every stream
identical, every layer covering every expert) or **cleanly stopped** (the server exits within
60 s), never hung; either way no process and no shm object is left.

    two_joiners    (``--redundant_experts_num=6``: 8 slots a rank, the rule holds down to 1)
                   ep1 killed; ep2 killed while ep1's joiner loads (dropped, started again);
                   ep3 killed while both joiners load -> 1 rank serves, 3 joiners, back at 4
    two_joiners_rule  the same at 4 slots a rank: the third death breaks the rule -> stop
    switch_serving ep1 killed; once its joiner has loaded, 8 more streams of 320 tokens start
                   (they run through the switch, ``join_delay`` 4 s later); rank 0 killed the moment ep1's joiner gets its go
                   (``EPLB elastic rejoin go``: the switch is under way) -> the switch is
                   abandoned, rank 0's death recovered (shrink), both joiners started again,
                   back at 4; every stream identical
    switch_joiner  the same, the joiner itself killed at its go -> abandoned, started again

    .venv/bin/python scripts/nested_faults.py --json /tmp/nested.json          # ~5 min
    .venv/bin/python scripts/nested_faults.py --only switch_serving
    .venv/bin/python scripts/nested_faults.py --quick    # two_joiners_rule only
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import psutil

from xllm_eplb.testing import elastic_load as L
from xllm_eplb.testing import elastic_measure as M
from xllm_eplb.testing.serving import Server, stream_completion, workers

BASE = ["--dtype=float64", "--elastic_ep=true", "--elastic_silence_seconds=2",
        "--max_batch_size=8", "--elastic_max_restarts=20", "--enable_eplb=false",
        "--enable_fault_injection=true"]
SCENARIOS = {"two_joiners": 6, "two_joiners_rule": 2, "switch_serving": 2, "switch_joiner": 2}
#: tokens of the streams started while the joiner loads (switch scenarios): they run through it
SWITCH_TOKENS = 320


def _worker(s: Server, w: int):
    return next(p for p in workers(s.proc.pid) if f"xllm-eplb:ep{w}" in " ".join(p.cmdline()))


def _until(cond, timeout: float, step: float = 0.005) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return True
        except (OSError, StopIteration, KeyError):
            pass
        time.sleep(step)
    return False


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _log(s: Server, logs: Path, name: str) -> str:
    p = logs / "latest" / name
    return p.read_text() if p.exists() else ""


def _start(s: Server, bodies, recs: list) -> list:
    """One streaming client thread per body, its record appended to ``recs``."""
    th = []
    for b in bodies:
        recs.append({})
        th.append(threading.Thread(target=stream_completion, args=(s.port, b, recs[-1]), daemon=True))
        th[-1].start()
    return th


def _in_flight(recs: list) -> int:
    """Streams that have tokens and are not done."""
    return sum(1 for r in recs if r.get("ids") and not r.get("done") and not r.get("error"))


def _faults(s: Server, logs: Path, name: str, late: list, recs: list, th: list,
            out: dict) -> list[str]:
    """Kill the workers the scenario names; returns what was done. Switch scenarios start the
    ``late`` bodies once the joiner loads and note the streams in flight at the second kill."""
    done = []
    kill = lambda w: (_worker(s, w).kill(), done.append(f"kill ep{w}"))  # noqa: E731
    joining = lambda: s.get("/eplb/status")["membership"]["joining"]  # noqa: E731
    kill(1)
    _until(lambda: joining() == ["ep1"], 30)
    if name.startswith("two_joiners"):
        time.sleep(1.0)
        kill(2)                                  # ep1's joiner dropped, started again
        _until(lambda: sorted(joining()) == ["ep1", "ep2"], 30)
        time.sleep(1.0)
        kill(3)                                  # while two joiners load
        return done
    _until(lambda: "EPLB elastic rejoin loaded rank=1" in _log(s, logs, "rank1.log"), 60, 0.05)
    th += _start(s, late, recs)              # the go follows --fault_inject=join_delay later
    go = "EPLB elastic rejoin go rank=1"
    if not _until(lambda: go in _log(s, logs, "rank1.log"), 60, 0.002):
        return done + ["no go line"]
    kill(0 if name == "switch_serving" else 1)
    out["in_flight_at_kill"], out["_kill_at"] = _in_flight(recs), time.time()
    return done


def _next_token(recs: list, at: float) -> float | None:
    """Kill -> the next token, the slowest of the streams in flight at ``at`` (seconds)."""
    gaps = [min(t for t in r["times"] if t > at) - at for r in recs
            if r.get("times") and r["times"][0] < at < r["times"][-1]]
    return round(max(gaps), 3) if gaps else None


def scenario(name: str, model: Path, tmp: Path, bodies, ref: dict) -> dict:
    logs = tmp / f"logs_{name}"
    delay = "seconds=4" if name.startswith("switch") else "seconds=6"
    s = Server(model, logs, BASE + [f"--redundant_experts_num={SCENARIOS[name]}",
                                    f"--fault_inject=join_delay:{delay}"])
    out: dict = {"scenario": name}
    try:
        s.wait_ready(300)
        late = ([L.body(i, SWITCH_TOKENS) for i in range(8, 16)]
                if name.startswith("switch") else [])
        todo = [b for b in bodies + late if json.dumps(b, sort_keys=True) not in ref]
        got = [None] * len(todo)

        def one(i: int) -> None:
            got[i] = L.complete(s.port, todo[i])
        refs = [threading.Thread(target=one, args=(i,)) for i in range(len(todo))]
        for t in refs:
            t.start()
        for t in refs:
            t.join()
        for b, ids in zip(todo, got, strict=True):
            if ids is None:
                raise RuntimeError("reference request failed")
            ref[json.dumps(b, sort_keys=True)] = ids
        want = [ref[json.dumps(b, sort_keys=True)] for b in bodies + late]
        recs: list = []
        th = _start(s, bodies, recs)
        out["faults"] = _faults(s, logs, name, late, recs, th, out)
        t0 = time.monotonic()
        back = _until(lambda: s.proc.poll() is not None or (
            (m := s.get("/eplb/status")["membership"])["ep_size"] == 4 and not m["joining"]),
            120, 0.2)
        for t in th:
            t.join(60)
        out["settle_s"] = round(time.monotonic() - t0, 3)
        bad = [f"stream {i}: {r.get('error') or M.token_faults(r.get('ids', []), want[i])}"
               for i, r in enumerate(recs)
               if r.get("error") or M.token_faults(r.get("ids", []), want[i])]
        out.update(streams=len(recs), bad_streams=len(bad), bad=bad[:4])
        if "_kill_at" in out:
            out["kill_to_next_token_s"] = _next_token(recs, out.pop("_kill_at"))
        if s.proc.poll() is None and back:
            st = s.get("/eplb/status")
            m = st["membership"]
            out.update(outcome="recovered", ep_size=st["ep_size"], joins=m["joins"],
                       joins_dropped=m["joins_dropped"], pg_generation=m["pg_generation"],
                       switches_abandoned=m.get("switches_abandoned", 0),
                       recoveries=m["recoveries"],
                       layers_uncovered=len(M.coverage_gaps(st["placement"], 8)))
        else:
            out["outcome"] = "stopped" if s.proc.poll() is not None else "HUNG"
    finally:
        seen = [p.pid for p in s.procs()]
        t1 = time.monotonic()
        rc = s.proc.poll()
        out["exit"] = rc if rc is not None else s.stop()
        out["stop_s"] = round(time.monotonic() - t1, 3)
        time.sleep(0.5)
        out["left_procs"] = sum(_alive(pid) for pid in seen)
        out["left_shm"] = sorted(p.name for p in Path("/dev/shm").glob(f"*{s.run_id}_*"))
        launcher = _log(s, logs, "launcher.log")
        out["launcher_lines"] = {k: launcher.count(f"EPLB elastic rejoin {k} ")
                                 for k in ("start", "restart", "dropped")}
        engine = _log(s, logs, "engine.log")
        out["abandoned"] = [" ".join(w for w in ln.split() if w.startswith(
            ("worker=", "regroup_sent=", "committed=", "seconds=")))
            for ln in engine.splitlines() if "EPLB elastic rejoin abandoned" in ln]
        err = [ln for ln in s.out.read_text().splitlines() if "error" in ln.lower()]
        out["error_line"] = err[-1][:300] if err else ""
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma list of scenarios")
    ap.add_argument("--quick", action="store_true",
                    help="one scenario, two_joiners_rule (about a minute)")
    ap.add_argument("--keep-logs", type=Path, help="copy each scenario's logs here")
    a = ap.parse_args()
    if a.quick:
        a.only = "two_joiners_rule"
    from xllm_eplb.model.checkpoint import make_checkpoint

    res = []
    with tempfile.TemporaryDirectory(prefix="nested_faults_") as d:
        tmp = Path(d)
        model = make_checkpoint("deepseek_v3", tmp / "ckpt", num_experts=8, top_k=2)
        bodies = [L.body(i, 48) for i in range(8)]
        ref: dict = {}
        for name in a.only.split(","):
            res.append(scenario(name, model, tmp, bodies, ref))
            if a.keep_logs:
                import shutil
                shutil.copytree(tmp / f"logs_{name}", a.keep_logs / name, dirs_exist_ok=True)
            print(json.dumps(res[-1]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
