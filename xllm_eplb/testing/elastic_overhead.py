"""Steady-state overhead of ``--elastic_ep`` with no fault (issue #23), for
``scripts/bench_elastic.py``: the direct cost and an honest black-box comparison.

Runs, per EP size, **sequentially** (one server at a time, all on the same cores: the bench
pins itself with ``--cores`` and every server inherits the mask): off, on, off, on, ..., off
(``pairs`` on runs, each between two off runs), EPLB off. Each run: a fresh server, one warm-up
workload, ``rounds`` measured workloads (16 requests at once, waited for), then ``idle_s``
seconds with no request.

* **direct** (on runs): the step loop's CPU inside the code that runs only because of
  elasticity, accounted by the engine itself (``/eplb/status`` ``critical_path``:
  ``elastic_engine_s``, the way ``eplb_engine_s`` / ``eplb_worker_s`` account EPLB), plus the
  CPU of the launcher's store thread (``pt_tcpstore_uv``: the TCPStore elasticity hosts in the
  launcher; /proc per-thread times), over all launcher + engine + worker CPU of the workload.
  The workers run no elastic-only code per step (``worker/worker.py``: ``self.elastic`` is
  read only when a step failed), so they add 0 by construction.
* **idle**: the engine process's CPU per second with no request (the loop wakes every
  ``ELASTIC_IDLE_WAIT`` = 0.05 s with elasticity, every 0.5 s without), and on runs the loop's
  own accounting (``elastic_idle_s`` / ``elastic_idle_wakes``: CPU per idle iteration).
* **black box**: process CPU (launcher + engine + workers, psutil) and wall clock per engine
  step; on / off = each on run over the mean of the off runs either side of it; A/A = each off
  run over the previous off run (the noise of the same measurement). Medians and ranges.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import psutil

from xllm_eplb.engine.engine import IDLE_WAIT
from xllm_eplb.testing.elastic_load import body, workload_cost
from xllm_eplb.testing.serving import Server

STORE_THREAD = "pt_tcpstore_uv"    # torch's TCPStore server thread (libuv)


def _proc_title(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(p.cmdline())
    return ""


def engine_proc(server) -> psutil.Process | None:
    return next((p for p in server.procs() if "xllm-eplb:engine" in _proc_title(p)), None)


def _task_cpu(pid: int, tid: int) -> float:
    """CPU seconds of one thread (``/proc/.../schedstat``: ns, not 10 ms ticks)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    return 0.0


def threads_cpu(p: psutil.Process | None) -> float:
    """CPU seconds of the live threads of ``p`` (ns resolution; for idle windows, where no
    thread comes or goes)."""
    tot = 0.0
    with contextlib.suppress(OSError, AttributeError):
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            tot += _task_cpu(p.pid, int(tid))
    return tot


def store_thread_cpu(server) -> tuple[float, int]:
    """CPU seconds of every TCPStore server thread of the run (on: the launcher's; off: the one
    worker 0 hosts for its ``tcp://`` rendezvous), and how many there are."""
    tot, n = 0.0, 0
    for p in server.procs():
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                comm = Path(f"/proc/{p.pid}/task/{tid}/comm").read_text().strip()
                if comm == STORE_THREAD:
                    tot, n = tot + _task_cpu(p.pid, int(tid)), n + 1
    return tot, n


def _cpu(p: psutil.Process | None) -> float:
    with contextlib.suppress(psutil.Error, AttributeError):
        c = p.cpu_times()
        return c.user + c.system
    return 0.0


def one_run(model: Path, logs: Path, flags: list[str], bodies, rounds: int,
            idle_s: float) -> dict:
    """One fresh server: warm-up, ``rounds`` workloads, ``idle_s`` idle; its numbers."""
    s = Server(model, logs, flags)
    try:
        s.wait_ready(300)
        workload_cost(s, bodies)                                     # warm-up
        eng, launcher = engine_proc(s), psutil.Process(s.proc.pid)
        maps = Path(f"/proc/{eng.pid}/maps").read_text()
        mem = {"engine_rss_mb": round(eng.memory_info().rss / 2**20, 1),
               "engine_has_torch": "libtorch_cpu" in maps}
        st0, l0, (k0, nk) = s.get("/eplb/status"), _cpu(launcher), store_thread_cpu(s)
        e0 = _cpu(eng)
        costs = [workload_cost(s, bodies) for _ in range(rounds)]
        st1, l1, (k1, _) = s.get("/eplb/status"), _cpu(launcher), store_thread_cpu(s)
        e1 = _cpu(eng)
        time.sleep(1.0)                        # the last replies' tail; then idle
        i0 = s.get("/eplb/status")["critical_path"]
        ie0, im0, iw0 = threads_cpu(eng), _task_cpu(eng.pid, eng.pid), time.perf_counter()
        time.sleep(idle_s)
        ie1, im1, iw1 = threads_cpu(eng), _task_cpu(eng.pid, eng.pid), time.perf_counter()
        i1 = s.get("/eplb/status")["critical_path"]
    finally:
        s.stop()

    def d(a: dict, b: dict, k: str) -> float:
        return float(b.get(k, 0.0)) - float(a.get(k, 0.0))
    cp0, cp1 = st0["critical_path"], st1["critical_path"]
    steps = sum(c["steps"] for c in costs)
    cpu = sum(c["cpu_s"] for c in costs)
    wakes = d(i0, i1, "elastic_idle_wakes")
    return {**mem, "steps": steps, "cpu_s": cpu, "wall_s": sum(c["wall_s"] for c in costs),
            "cpu_ms_per_step": 1e3 * cpu / max(1, steps),
            "engine_cpu_s": e1 - e0, "launcher_cpu_s": l1 - l0, "store_thread_cpu_s": k1 - k0,
            "store_threads": nk,
            "elastic_engine_s": d(cp0, cp1, "elastic_engine_s"),
            "idle_engine_cpu_pct": 100 * (ie1 - ie0) / (iw1 - iw0),
            "idle_loop_thread_cpu_pct": 100 * (im1 - im0) / (iw1 - iw0),
            "idle_wakes_per_s": wakes / (iw1 - iw0),
            "idle_us_per_wake": 1e6 * d(i0, i1, "elastic_idle_s") / wakes if wakes else None,
            "idle_loop_cpu_pct": 100 * d(i0, i1, "elastic_idle_s") / (iw1 - iw0),
            # the wakes off would not make (it wakes every IDLE_WAIT s) x CPU per wake
            "idle_extra_cpu_pct": (100 * d(i0, i1, "elastic_idle_s") / wakes
                                   * (wakes / (iw1 - iw0) - 1 / IDLE_WAIT)) if wakes else None}


def _stats(xs: list[float], digits: int = 4) -> dict:
    return {"median": round(float(np.median(xs)), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits), "n": len(xs)} if xs else {}


def overhead_ep(model: Path, tmp: Path, ep: int, experts: int, dtype: str, pairs: int,
                rounds: int, tokens: int, idle_s: float) -> dict:
    """off, on, off, ..., off (``pairs`` on runs) at EP ``ep``; see the module docstring."""
    # the same redundancy on and off: enough for elasticity's rule (N-1 ranks hold every expert)
    need = max(2, -(-experts // max(ep - 1, 1)) - experts // ep)
    base = [f"--dtype={dtype}", f"--redundant_experts_num={need}", "--max_batch_size=8",
            "--enable_eplb=false", "--ep-size", str(ep)]
    bodies = [body(i, tokens) for i in range(16)]
    runs: list[dict] = []
    for i in range(2 * pairs + 1):
        on = i % 2 == 1
        r = one_run(model, tmp / f"logs_ovh{ep}_{i}", base + [f"--elastic_ep={str(on).lower()}"],
                    bodies, rounds, idle_s)
        runs.append({"elastic": on, **r})
    off = [r for r in runs if not r["elastic"]]
    on = [r for r in runs if r["elastic"]]

    def per_step(r: dict, k: str) -> float:
        return r[k] / max(1, r["steps"])

    def ratios(k: str) -> tuple[list[float], list[float]]:
        ab = [per_step(x, k) / (0.5 * (per_step(a, k) + per_step(b, k)))
              for x, a, b in zip(on, off, off[1:], strict=False)]
        aa = [per_step(b, k) / per_step(a, k) for a, b in zip(off, off[1:], strict=False)]
        return ab, aa

    cpu_ab, cpu_aa = ratios("cpu_s")
    wall_ab, wall_aa = ratios("wall_s")
    # direct: the engine's elastic-only CPU plus the launcher's store thread, over all CPU
    direct = [100 * (r["elastic_engine_s"] + r["store_thread_cpu_s"]) / r["cpu_s"] for r in on]
    return {
        "ep": ep, "redundant_experts_num": need, "pairs": pairs, "rounds_per_run": rounds, "requests": len(bodies),
        "tokens": tokens, "order": ["on" if r["elastic"] else "off" for r in runs],
        "steps": [r["steps"] for r in runs],
        "cpu_ms_per_step": [round(r["cpu_ms_per_step"], 3) for r in runs],
        "direct_pct": _stats(direct, 5),
        "direct_us_per_step": _stats([1e6 * r["elastic_engine_s"] / r["steps"] for r in on]),
        "store_thread_cpu_s": [round(r["store_thread_cpu_s"], 6) for r in runs],
        "store_threads": [r["store_threads"] for r in runs],
        "engine_rss_mb": [r["engine_rss_mb"] for r in runs],
        "engine_has_torch": [r["engine_has_torch"] for r in runs],
        "launcher_share": _stats([r["launcher_cpu_s"] / r["cpu_s"] for r in runs]),
        "engine_share": _stats([r["engine_cpu_s"] / r["cpu_s"] for r in runs]),
        "cpu_on_off": _stats(cpu_ab), "cpu_off_off": _stats(cpu_aa),
        "wall_on_off": _stats(wall_ab), "wall_off_off": _stats(wall_aa),
        "idle_engine_cpu_pct": {"on": _stats([r["idle_engine_cpu_pct"] for r in on]),
                                "off": _stats([r["idle_engine_cpu_pct"] for r in off])},
        "idle_loop_thread_cpu_pct": {"on": _stats([r["idle_loop_thread_cpu_pct"] for r in on]),
                                     "off": _stats([r["idle_loop_thread_cpu_pct"] for r in off])},
        "idle_wakes_per_s": _stats([r["idle_wakes_per_s"] for r in on]),
        "idle_us_per_wake": _stats([r["idle_us_per_wake"] for r in on
                                    if r["idle_us_per_wake"] is not None]),
        "idle_loop_cpu_pct": _stats([r["idle_loop_cpu_pct"] for r in on]),
        "idle_extra_cpu_pct_direct": _stats([r["idle_extra_cpu_pct"] for r in on
                                             if r["idle_extra_cpu_pct"] is not None]),
    }


def overhead(a, model: Path, tmp: Path) -> dict:
    """Every EP size of ``--overhead-eps`` on the cores of ``--cores``."""
    if a.cores:
        os.sched_setaffinity(0, _cores(a.cores))
    t0 = time.monotonic()
    got = [overhead_ep(model, tmp, int(ep), a.experts, a.dtype, a.overhead_pairs,
                       a.overhead_rounds, a.overhead_tokens, a.overhead_idle_s)
           for ep in str(a.overhead_eps).split(",")]
    return {"cores": sorted(os.sched_getaffinity(0)), "by_ep": got,
            "wall_s": round(time.monotonic() - t0, 1)}


def _cores(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out
