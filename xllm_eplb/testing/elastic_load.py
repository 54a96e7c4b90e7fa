"""The load side of ``scripts/bench_elastic.py`` and ``scripts/nested_faults.py`` (issue #23
acceptance): streaming clients that stamp every token, the kill trials (a worker SIGKILLed at a chosen moment: prefill, decode, an
EPLB round in flight, the re-prefill just after a recovery), closed-loop load around a kill
(throughput after recovery) and the CPU per step of a fixed workload (steady-state overhead).
"""

from __future__ import annotations

import contextlib
import threading
import time

import psutil

from xllm_eplb.testing import serving
from xllm_eplb.testing.serving import kill_worker, stream_completion

PROMPTS = ["the engine", "a rank dies", "experts move", "no request is lost", "seeded",
           "tokens stay", "x", "balance the load"]


def body(i: int, n: int) -> dict:
    """Request ``i``: greedy when even, seeded sampling when odd; ``n`` tokens, no EOS stop."""
    return {"model": "xllm-eplb", "prompt": PROMPTS[i % len(PROMPTS)] + f" {i}",
            "max_tokens": n, "temperature": 0.8 if i % 2 else 0.0, "seed": 100 + i,
            "ignore_eos": True, "return_token_ids": True}


def complete(port: int, b: dict) -> list[int]:
    """Token ids of one non-streaming completion (the reference run); raises on an error."""
    got = serving.complete(port, b, stream=False)
    if isinstance(got, str):
        raise RuntimeError(f"reference request: {got}")
    return got


def _wait(cond, timeout: float, step: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return False


def kill_trial(server, bodies: list[dict], kind: str, rng) -> dict:
    """``len(bodies)`` concurrent streams and one or two SIGKILLs at the moment ``kind`` names:
    ``prefill`` (0-0.04 s after the requests are sent: labelled so when no stream has a
    token yet),
    ``decode`` (every stream has 2-12 tokens), ``migration`` (``/eplb/status``
    ``round_in_progress``: an EPLB round in flight; decode when none starts within 15 s),
    ``reprefill`` (a decode kill, then a second one 0-0.3 s after its recovery resumed: the
    requests are being re-prefilled). Returns the streams and the kill times with labels."""
    recs = [{} for _ in bodies]
    th = [threading.Thread(target=stream_completion, args=(server.port, b, r), daemon=True)
          for b, r in zip(bodies, recs, strict=True)]
    for t in th:
        t.start()
    ntok = lambda: min(len(r.get("ids", ())) for r in recs)  # noqa: E731
    kills: list[tuple[float, str]] = []
    if kind == "prefill":
        time.sleep(rng.uniform(0.0, 0.04))
        first = max(len(r.get("ids", ())) for r in recs) == 0
        label = "prefill" if first else "decode"
        kills.append((kill_worker(server, rng), label))
    elif kind == "migration":
        _wait(lambda: ntok() >= 2, 60)
        hit = _wait(lambda: server.get("/eplb/status").get("round_in_progress"), 15, 0.02)
        kills.append((kill_worker(server, rng), "migration" if hit else "decode"))
    else:
        want = rng.randint(2, 12)
        _wait(lambda: ntok() >= want, 60)
        before = server.get("/eplb/status")["membership"].get("recoveries", 0)
        kills.append((kill_worker(server, rng), "decode"))
        if kind == "reprefill":
            ok = _wait(lambda: server.get("/eplb/status")["membership"].get("recoveries", 0)
                       > before, 60, 0.02)
            time.sleep(rng.uniform(0.0, 0.3))
            kills.append((kill_worker(server, rng), "reprefill" if ok else "late"))
    for t in th:
        t.join(240)
    return {"recs": recs, "kills": kills}


def idle_kill(server, rng) -> float:
    """SIGKILL a worker of an idle server (no request) 0.3-1 s after it went idle; wait for
    its recovery. Returns the kill time."""
    before = server.get("/eplb/status")["membership"].get("recoveries", 0)
    time.sleep(rng.uniform(0.3, 1.0))
    t = kill_worker(server, rng)
    _wait(lambda: server.get("/eplb/status")["membership"].get("recoveries", 0) > before, 60,
          0.05)
    return t


def wait_join(server, ep: int, timeout: float = 120.0, kills: int = 0) -> dict:
    """``--elastic_rejoin``: wait until the server has recovered ``kills`` deaths so far and is
    back at ``ep`` ranks; its ``last_join`` (``{}`` before any). NOTE: ``kills``: a worker
    killed after its streams ended dies unseen by an idle engine for a moment, and the server
    still reads ``ep`` ranks then (the next trial would kill a second rank of the old world)."""
    m: dict = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = server.get("/eplb/status")["membership"]
        if m["ep_size"] == ep and not m.get("joining") and m.get("recoveries", 0) >= kills:
            return dict(m.get("last_join") or {})
        time.sleep(0.1)
    raise RuntimeError(f"not back at {ep} ranks within {timeout:g} s: {m}")


def gaps(recs: list[dict], t_kill: float) -> list[float]:
    """Per request in flight at ``t_kill`` (not finished before it): kill -> its next token."""
    out = []
    for r in recs:
        ts = r.get("times", [])
        if ts and ts[-1] < t_kill and r.get("done"):
            continue                         # finished before the kill
        nxt = [x for x in ts if x > t_kill]
        out.append(nxt[0] - t_kill if nxt else float("nan"))
    return out


class ClosedLoop:
    """``n`` threads, each streaming one request after another (bodies round-robin) until
    :meth:`close`; every token's arrival time is kept, every reply checked against ``ref``."""

    def __init__(self, port: int, bodies: list[dict], ref: list[list[int]], n: int):
        self.port, self.bodies, self.ref = port, bodies, ref
        self.times: list[float] = []
        self.ok = self.errors = self.mismatches = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.th = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.th:
            t.start()

    def _run(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            rec: dict = {}
            stream_completion(self.port, self.bodies[k % len(self.bodies)], rec)
            with self.lock:
                self.times += rec["times"]
                if rec["error"] or not rec["done"]:
                    self.errors += 1
                else:
                    self.ok += 1
                    self.mismatches += rec["ids"] != self.ref[k % len(self.bodies)]
            k += len(self.th)

    def close(self) -> None:
        self.stop.set()
        for t in self.th:
            t.join(240)


def cpu_seconds(server) -> float:
    """User + system CPU of the launcher, the engine and every worker."""
    tot = 0.0
    for p in server.procs():
        with contextlib.suppress(psutil.Error):
            c = p.cpu_times()
            tot += c.user + c.system
    return tot


def workload_cost(server, bodies: list[dict]) -> dict:
    """One fixed workload (``bodies`` all at once, non-streaming, waited for): process CPU,
    wall clock and engine steps it took."""
    st0, c0, w0 = server.get("/eplb/status")["step"], cpu_seconds(server), time.perf_counter()
    th = [threading.Thread(target=complete, args=(server.port, b), daemon=True) for b in bodies]
    for t in th:
        t.start()
    for t in th:
        t.join(300)
    w1, c1, st1 = time.perf_counter(), cpu_seconds(server), server.get("/eplb/status")["step"]
    return {"cpu_s": c1 - c0, "wall_s": w1 - w0, "steps": st1 - st0}
