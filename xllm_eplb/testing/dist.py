"""Run a function on N real processes joined by torch.distributed (tests and benchmarks).

``run_ranks(fn, world_size, *args)`` spawns one process per rank, initialises a gloo (or given)
process group on a free loopback port, calls ``fn(rank, world_size, *args)`` and returns the
list of per-rank return values. Any rank's exception or a timeout kills every rank and raises
``RankFailure`` naming the rank; no process is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, backend, args, results, timeout):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        out = fn(rank, world, *args)
        results.send((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.send((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              backend: str = "gloo") -> list[Any]:
    """``fn`` must be importable (module level). Returns results ordered by rank."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(fn, r, world_size, port, backend, args, pipes[r][1], timeout))
             for r in range(world_size)]
    for p, (_, w) in zip(procs, pipes, strict=True):
        p.start()
        w.close()            # the child holds its own end: EOF when it is gone
    out: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        live = [r for r, _ in pipes]
        while len(out) < world_size:
            ready = mpc.wait(live, max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(set(range(world_size)) - set(out))
                raise RankFailure(f"ranks {missing} produced no result within {timeout}s")
            for conn in ready:
                live.remove(conn)
                try:
                    rank, ok, val = conn.recv()
                except EOFError:
                    rank = next(i for i, (r, _) in enumerate(pipes) if r is conn)
                    raise RankFailure(f"rank {rank} exited without a result") from None
                if not ok:
                    raise RankFailure(f"rank {rank} failed:\n{val}")
                out[rank] = val
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for r, _ in pipes:
            r.close()
    return [out[r] for r in range(world_size)]
