#!/usr/bin/env python
"""Control messages of one step, engine <-> a remote node (gloo bridges) vs the local shm path.

EP4 on two nodes (2 + 2) on one machine, the real components: node 0's rings (input ring with
4 readers, out0..out3), node 1's rings (2 readers, out2, out3), the two bridges of
``xllm_eplb/node/bridge.py`` (``Hub`` / ``Relay`` on a gloo pair over a TCPStore) and four echo
workers that answer each ``ForwardInput`` with a ``ForwardOutput`` of a decode step's size
(counters [L_moe, S] int64, one sampled token per row). One step = the engine puts one
ForwardInput (4 ranks x ``--rows`` decode rows) and gets the 4 outputs. Per step:

* ``local``  : time until both node-0 ranks' outputs are in (shm ring only)
* ``remote`` : time until both node-1 ranks' outputs are in (shm -> hub -> gloo -> relay -> shm
               -> echo -> shm -> relay -> gloo -> hub -> shm)

Without ``--quick`` it also starts a real two-node ``serve`` (generated checkpoint, loopback),
drives three greedy 32-token requests one after another (after one warm request) and reads the
engine's mean step time over them from ``/metrics`` (one prefill + 31 decode steps each), to
give the share of a real EP4 (2 + 2) step the remote control path costs.

    python scripts/bench_multinode.py [--quick] [--json PATH] [--steps N] [--rows R]

JSON keys: ``local_p50_us``, ``remote_p50_us``, ``remote_over_local``, ``extra_p50_us``
(remote - local), ``decode_step_ms`` and ``extra_share_of_step`` (full run only), ``rows``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from xllm_eplb.config import Config, EplbConfig, RuntimeConfig
from xllm_eplb.eplb.info import EplbInfo
from xllm_eplb.ipc.messages import ForwardInput, ForwardOutput
from xllm_eplb.ipc.objects import clean
from xllm_eplb.ipc.ring import InputRing, OutputRing
from xllm_eplb.model.batch import RankBatch, SeqRow

L_MOE, SLOTS = 3, 17


def _cfg(run: str, node: int, port: int) -> Config:
    rt = RuntimeConfig(nnodes=2, node_rank=node, master_port=port, run_id=f"{run}-n{node}")
    return Config(eplb=EplbConfig(ep_size=4), runtime=rt)


def _echo(run_id: str, reader: int, rank: int) -> None:
    """One echo worker: answer every ForwardInput with a decode-sized ForwardOutput."""
    inp = InputRing.attach(run_id, reader_index=reader, timeout=30)
    out = OutputRing.attach(run_id, rank, timeout=30)
    counters = np.arange(L_MOE * SLOTS, dtype=np.int64).reshape(L_MOE, SLOTS)
    while True:
        msg = inp.get(timeout=60)
        if msg.shutdown:
            break
        rows = msg.batches[rank].rows
        out.put(ForwardOutput(step=msg.step, rank=rank, counters=counters,
                              sampled={r.req_id: 7 for r in rows}), timeout=60)
    inp.close()
    out.close()


def _bridge(cfg: Config, role: str, origin: str, port: int) -> None:
    from xllm_eplb.node.bridge import Hub, Link, Relay

    end = Hub(cfg, 1) if role == "hub" else Relay(cfg, origin)
    end.link = Link("127.0.0.1", port, 1, 0 if role == "hub" else 1, 60)
    try:
        end.serve(os.getppid())
    finally:
        end.close()
        end.link.close()


def _msg(step: int, rows: int) -> ForwardInput:
    batches = [RankBatch([SeqRow(r * 1000 + i, [11 + i], 40 + step, False) for i in range(rows)])
               for r in range(4)]
    return ForwardInput(step, batches, EplbInfo(), pure_decode=True)


def control_path(steps: int, rows: int) -> dict:
    import torch.distributed as dist

    from xllm_eplb.testing.dist import free_port

    run = f"bmn{os.getpid()}"
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    n0, n1 = _cfg(run, 0, port), _cfg(run, 1, port)
    rings = [InputRing.create(n0.runtime.run_id, 4, 8, 1 << 20),
             *[OutputRing.create(n0.runtime.run_id, r, 8, 256 << 10, checksum=True)
               for r in range(4)]]
    remote = [InputRing.create(n1.runtime.run_id, 2, 8, 1 << 20, producer=False),
              *[OutputRing.create(n1.runtime.run_id, r, 8, 256 << 10, reader=False,
                                  checksum=True) for r in (2, 3)]]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_echo, args=(n0.runtime.run_id, r, r)) for r in (0, 1)]
    procs += [ctx.Process(target=_echo, args=(n1.runtime.run_id, r - 2, r)) for r in (2, 3)]
    procs += [ctx.Process(target=_bridge, args=(n0, "hub", n0.runtime.run_id, port)),
              ctx.Process(target=_bridge, args=(n1, "relay", n0.runtime.run_id, port))]
    for p in procs:
        p.start()
    inp, outs = rings[0], rings[1:]
    local, far = [], []
    try:
        for step in range(1, steps + 11):
            t0 = time.perf_counter()
            inp.put(_msg(step, rows), timeout=60)
            for r in (0, 1):
                outs[r].get(timeout=60)
            t1 = time.perf_counter()
            for r in (2, 3):
                outs[r].get(timeout=60)
            t2 = time.perf_counter()
            if step > 10:                      # 10 warm-up steps
                local.append((t1 - t0) * 1e6)
                far.append((t2 - t0) * 1e6)
        inp.put(ForwardInput.make_shutdown(steps + 11), timeout=10)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for ring in rings + remote:
            ring.close()
        clean(n0.runtime.run_id, force=True)
        clean(n1.runtime.run_id, force=True)
        del store
    lp, rp = statistics.median(local), statistics.median(far)
    return {"local_p50_us": round(lp, 1), "remote_p50_us": round(rp, 1),
            "local_p90_us": round(float(np.percentile(local, 90)), 1),
            "remote_p90_us": round(float(np.percentile(far, 90)), 1),
            "remote_over_local": round(rp / lp, 2), "extra_p50_us": round(rp - lp, 1),
            "steps": steps, "rows_per_rank": rows}


def decode_step_ms(tokens: int) -> float:
    """Mean decode step (ms) of a real two-node EP4 serve on loopback (from /metrics)."""
    import re
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile
    import urllib.request
    from pathlib import Path

    from xllm_eplb.model.checkpoint import make_checkpoint
    from xllm_eplb.testing.dist import free_port

    tmp = Path(tempfile.mkdtemp(prefix="bench_mn_"))
    ckpt = make_checkpoint("deepseek_v3", tmp / "ckpt", seed=0)
    mport, hport = free_port(), free_port()
    procs = []
    for n in (0, 1):
        cmd = [sys.executable, "-m", "xllm_eplb", "serve", "--ep-size", "4", "--model", str(ckpt),
               "--nnodes", "2", "--node-rank", str(n), "--master-port", str(mport),
               "--port", str(hport), "--log_dir", str(tmp / "logs")]
        procs.append(subprocess.Popen(cmd, stdout=(tmp / f"n{n}.out").open("w"),
                                      stderr=(tmp / f"n{n}.err").open("w"),
                                      start_new_session=True))
    url = f"http://127.0.0.1:{hport}"
    try:
        deadline = time.monotonic() + 300
        while "xllm-eplb ready" not in (tmp / "n0.out").read_text():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"no ready line: {(tmp / 'n0.err').read_text()[-2000:]}")
            time.sleep(0.5)
        body = json.dumps({"prompt": [5, 17, 300, 42], "max_tokens": tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        def steps() -> tuple[float, float]:
            text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
            return tuple(float(re.search(rf"^xllm_eplb_step_duration_seconds_{k} (\S+)", text,
                                         re.M)[1]) for k in ("sum", "count"))

        def request() -> None:
            urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body),
                                   timeout=120).read()

        request()                       # warm; the warm-up forwards stay out of the diff
        s0, c0 = steps()
        for _ in range(3):
            request()
        s1, c1 = steps()
        return (s1 - s0) / (c1 - c0) * 1e3
    finally:
        os.kill(procs[0].pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="control path only, fewer steps")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rows", type=int, default=8, help="decode rows per rank")
    a = ap.parse_args()
    steps = a.steps or (200 if a.quick else 1000)
    res = control_path(steps, a.rows)
    if not a.quick:
        res["decode_step_ms"] = round(decode_step_ms(32), 2)
        res["extra_share_of_step"] = round(res["extra_p50_us"] / 1e3 / res["decode_step_ms"], 4)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
