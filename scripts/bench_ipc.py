#!/usr/bin/env python
"""Round trip engine -> N workers -> engine: shm rings vs multiprocessing.Pipe vs gloo.

One exchange = the engine sends a P-byte payload to every worker, every worker sends P bytes
back, the engine has all N answers. Transports, all in the same run:

* ``shm``  : :class:`xllm_eplb.ipc.ring.InputRing` (broadcast) + one ``OutputRing`` per worker,
             raw frames (``put_bytes``/``get_bytes``: framing + header crc, no msgpack), the
             default rings
* ``shm_checked`` : the same rings created with ``checksum=True`` (body checksum per frame)
* ``pipe`` : one ``multiprocessing.Pipe`` per worker, ``send_bytes``/``recv_bytes``
* ``gloo`` : world N+1, ``dist.broadcast`` from rank 0 + ``dist.gather`` to rank 0 (uint8)

shm and pipe run interleaved in chunks of 25 round trips (same machine load for both); gloo
runs in its own world afterwards. Also measures the CPU use of an idle engine + 16 idle workers
blocked on the rings.

    python scripts/bench_ipc.py [--quick] [--json PATH] [--no-gloo]

JSON keys: ``shm_p50_us``, ``pipe_p50_us``, ``gloo_p50_us`` (16 workers, 4 KiB),
``shm_over_pipe``, ``shm_over_gloo``, ``shm_cpu_us_per_rt`` / ``pipe_cpu_us_per_rt`` (schedstat
CPU of engine thread + workers), ``shm_engine_sleeps_per_rt`` / ``pipe_engine_sleeps_per_rt``
(voluntary context switches of the engine thread), ``idle_cpu`` (% of one core), ``rows``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
import uuid

import numpy as np
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from xllm_eplb.ipc import objects  # noqa: E402
from xllm_eplb.ipc.errors import RingTimeoutError  # noqa: E402
from xllm_eplb.ipc.ring import InputRing, OutputRing  # noqa: E402

STOP = b"stop"
FRAME = 256 * 1024 + 4096
CTX = mp.get_context("fork")


def _shm_worker(run_id: str, r: int) -> None:
    inp = InputRing.attach(run_id, r, timeout=30)
    out = OutputRing.attach(run_id, r, timeout=30)
    try:
        while True:
            body = inp.ring.get_bytes(None)
            if body == STOP:
                break
            out.ring.put_bytes(body, None)
    finally:
        inp.close()
        out.close()


def _pipe_worker(conn) -> None:
    while True:
        b = conn.recv_bytes()
        if b == STOP:
            break
        conn.send_bytes(b)


def _pct(lat_s: list[float]) -> tuple[float, float]:
    a = np.asarray(lat_s) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


class ShmSide:
    """Engine end of the rings + N forked workers echoing every frame."""

    def __init__(self, n: int, checksum: bool):
        self.run_id = "bench" + uuid.uuid4().hex[:8]
        self.inp = InputRing.create(self.run_id, n, slots=4, frame_bytes=FRAME, checksum=checksum)
        self.outs = [OutputRing.create(self.run_id, r, slots=4, frame_bytes=FRAME,
                                       checksum=checksum) for r in range(n)]
        self.procs = [CTX.Process(target=_shm_worker, args=(self.run_id, r)) for r in range(n)]
        for p in self.procs:
            p.start()

    def round_trip(self, body: bytes) -> None:
        self.inp.ring.put_bytes(body, 30)
        for o in self.outs:
            o.ring.get_bytes(30)

    def close(self) -> None:
        try:
            self.inp.ring.put_bytes(STOP, 30)
            for p in self.procs:
                p.join(30)
        finally:
            _kill(self.procs)
            self.inp.close()
            for o in self.outs:
                o.close()
            objects.clean(self.run_id, force=True)


class PipeSide:
    """One multiprocessing.Pipe per forked worker, echoing every message."""

    def __init__(self, n: int):
        pairs = [CTX.Pipe() for _ in range(n)]
        self.procs = [CTX.Process(target=_pipe_worker, args=(child,)) for _, child in pairs]
        self.conns = [parent for parent, _ in pairs]
        for p in self.procs:
            p.start()

    def round_trip(self, body: bytes) -> None:
        for c in self.conns:
            c.send_bytes(body)
        for c in self.conns:
            c.recv_bytes()

    def close(self) -> None:
        try:
            for c in self.conns:
                c.send_bytes(STOP)
            for p in self.procs:
                p.join(30)
        finally:
            _kill(self.procs)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def bench_local(n: int, payloads: list[int], iters: int, chunk: int = 25, idle_s: float = 0.0):
    """shm (default), shm_checked (body checksums) and pipe, interleaved in chunks of ``chunk`` round trips
    so the three see the same machine load. Returns ({transport: {payload: (p50_us, p99_us,
    cpu_us_per_round_trip, engine_sleeps_per_round_trip)}}, idle); CPU = engine thread +
    workers, from schedstat; sleeps = the engine thread's voluntary context switches."""
    sides = {}
    idle = None
    try:
        sides["shm"] = ShmSide(n, checksum=False)
        sides["shm_checked"] = ShmSide(n, checksum=True)
        sides["pipe"] = PipeSide(n)
        res = {k: {} for k in sides}
        for size in payloads:
            body = os.urandom(size)
            lat = {k: [] for k in sides}
            for side in sides.values():           # warm-up
                for _ in range(max(5, chunk)):
                    side.round_trip(body)
            cpu = {k: 0 for k in sides}
            sleeps = {k: 0 for k in sides}
            for _ in range(max(1, iters // chunk)):
                for k, side in sides.items():
                    c0, v0 = _side_cpu_ns(side), _own_sleeps()
                    for _ in range(chunk):
                        t0 = time.perf_counter()
                        side.round_trip(body)
                        lat[k].append(time.perf_counter() - t0)
                    cpu[k] += _side_cpu_ns(side) - c0
                    sleeps[k] += _own_sleeps() - v0
            for k in sides:
                res[k][size] = _pct(lat[k]) + (cpu[k] / 1e3 / len(lat[k]),
                                               sleeps[k] / len(lat[k]))
        if idle_s:
            shm = sides["shm"]
            idle = _idle_cpu([psutil.Process(p.pid) for p in shm.procs], shm.outs[0], idle_s)
    finally:
        for side in sides.values():
            side.close()
    return res, idle


def _side_cpu_ns(side) -> int:
    """CPU ns used so far by this (engine) thread + the side's workers."""
    with open("/proc/thread-self/schedstat") as f:
        me = int(f.read().split()[0])
    return me + sum(_cpu_ns(p.pid) for p in side.procs)


def _own_sleeps() -> int:
    """Voluntary context switches of this (engine) thread so far (each = one sleep)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def _cpu_ns(pid: int) -> int:
    """CPU time (ns) of every thread of ``pid`` from /proc schedstat (finer than ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def _idle_cpu(workers, out_ring, idle_s: float) -> dict:
    """CPU of the engine (a thread blocked in OutputRing.get) + idle workers blocked in
    InputRing.get, as % of one core: psutil cpu_times (10 ms ticks) and schedstat (ns)."""
    me = psutil.Process()
    waiter = threading.Thread(target=_expect_timeout, args=(out_ring, idle_s + 1.0))
    waiter.start()
    time.sleep(0.3)
    procs = [me] + workers
    t0 = [sum(p.cpu_times()[:2]) for p in procs]
    ns0 = [_cpu_ns(p.pid) for p in procs]
    w0 = time.monotonic()
    time.sleep(idle_s)
    used = sum(sum(p.cpu_times()[:2]) - b for p, b in zip(procs, t0, strict=True))
    used_ns = sum(_cpu_ns(p.pid) - b for p, b in zip(procs, ns0, strict=True))
    wall = time.monotonic() - w0
    waiter.join()
    return {"psutil_pct": round(100.0 * used / wall, 3),
            "schedstat_pct": round(100.0 * used_ns / 1e9 / wall, 3),
            "seconds": round(wall, 2), "processes": len(procs)}


def _expect_timeout(ring, timeout: float) -> None:
    try:
        ring.get(timeout=timeout)
    except RingTimeoutError:
        pass


def _gloo_rank(rank: int, world: int, payloads: list[int], iters: int):
    import torch
    import torch.distributed as dist

    out = {}
    for size in payloads:
        t = torch.zeros(size, dtype=torch.uint8)
        gl = [torch.empty_like(t) for _ in range(world)] if rank == 0 else None
        lat = []
        for i in range(iters + iters // 5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(t, src=0)
            dist.gather(t, gather_list=gl, dst=0)
            if i >= iters // 5:
                lat.append(time.perf_counter() - t0)
        out[size] = _pct(lat)
    return out


def _gloo_entry(rank: int, world: int, port: int, payloads, iters, conn) -> None:
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        out = _gloo_rank(rank, world, payloads, iters)
        dist.destroy_process_group()
        conn.send(("ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(e)))


def bench_gloo(n: int, payloads: list[int], iters: int):
    """World n+1 forked from this process (torch imported once, before the fork: a spawn
    start of 17 torch processes takes most of a minute on 2 cores)."""
    import torch  # noqa: F401 - imported before forking on purpose

    from xllm_eplb.testing.dist import free_port

    port, world = free_port(), n + 1
    pipes = [CTX.Pipe(duplex=False) for _ in range(world)]
    procs = [CTX.Process(target=_gloo_entry, args=(r, world, port, payloads, iters, w))
             for r, (_, w) in enumerate(pipes)]
    try:
        for p in procs:
            p.start()
        results = []
        for rd, _ in pipes:
            if not rd.poll(300):
                raise RuntimeError("gloo baseline: a rank produced no result within 300 s")
            results.append(rd.recv())
        bad = [r for r in results if r[0] != "ok"]
        if bad:
            raise RuntimeError(f"gloo baseline failed: {bad[0][1]}")
        for p in procs:
            p.join(30)
        return results[0][1]
    finally:
        _kill(procs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 workers x 4 KiB only, fewer iters")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON")
    ap.add_argument("--iters", type=int, default=None, help="round trips per transport and size")
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--no-gloo", action="store_true", help="skip the torch.distributed baseline")
    a = ap.parse_args(argv)
    workers = [16] if a.quick else [4, 16]
    payloads = [4096] if a.quick else [256, 4096, 256 * 1024]
    iters = a.iters or (300 if a.quick else 1000)
    gloo_iters = 30 if a.quick else 100
    rows, idle = [], None
    for n in workers:
        local, idle_n = bench_local(n, payloads, iters, idle_s=a.idle_seconds if n == 16 else 0)
        idle = idle_n or idle
        if not a.no_gloo:
            local["gloo"] = bench_gloo(n, payloads, gloo_iters)
        for size in payloads:
            for name, r in local.items():
                cpu = round(r[size][2], 1) if len(r[size]) > 2 else None
                rows.append({"workers": n, "payload_bytes": size, "transport": name,
                             "p50_us": round(r[size][0], 1), "p99_us": round(r[size][1], 1),
                             "cpu_us_per_rt": cpu,
                             "engine_sleeps_per_rt": (round(r[size][3], 2) if len(r[size]) > 3
                                                      else None),
                             "iters": gloo_iters if name == "gloo" else iters})
    print(f"{'workers':>7} {'payload':>8} {'transport':>10} {'p50_us':>10} {'p99_us':>10} "
          f"{'cpu_us/rt':>10}")
    for r in rows:
        cpu = "-" if r["cpu_us_per_rt"] is None else f"{r['cpu_us_per_rt']:.1f}"
        print(f"{r['workers']:>7} {r['payload_bytes']:>8} {r['transport']:>10} "
              f"{r['p50_us']:>10.1f} {r['p99_us']:>10.1f} {cpu:>10}")
    sel = [r for r in rows if r["workers"] == 16 and r["payload_bytes"] == 4096]
    key = {r["transport"]: r["p50_us"] for r in sel}
    cpu = {r["transport"]: r["cpu_us_per_rt"] for r in sel}
    sleeps = {r["transport"]: r["engine_sleeps_per_rt"] for r in sel}
    summary = {"shm_p50_us": key["shm"], "shm_checked_p50_us": key["shm_checked"],
               "pipe_p50_us": key["pipe"], "gloo_p50_us": key.get("gloo"),
               "shm_over_pipe": round(key["shm"] / key["pipe"], 3),
               "shm_over_gloo": round(key["shm"] / key["gloo"], 4) if "gloo" in key else None,
               "shm_cpu_us_per_rt": cpu["shm"], "pipe_cpu_us_per_rt": cpu["pipe"],
               "shm_over_pipe_cpu": round(cpu["shm"] / cpu["pipe"], 3),
               "shm_engine_sleeps_per_rt": sleeps["shm"],
               "pipe_engine_sleeps_per_rt": sleeps["pipe"],
               "idle_cpu": idle, "cpu_count": os.cpu_count(),
               "loadavg_1m": round(os.getloadavg()[0], 2), "quick": a.quick, "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
