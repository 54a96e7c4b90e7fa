"""The one harness the benchmark scripts and the serving tests share: a real
``xllm-eplb serve`` subprocess (:class:`Server`: start, wait ready, status, stop), requests to
it (:func:`complete`, :func:`stream_completion`, token-id prompts), the streaming load compared with a
fault-free reference (:func:`prompt_pool`, :class:`Clients`), killing ranks (:func:`workers`,
:func:`kill_worker`, :class:`Chaos`) and Hugging Face's greedy generation as the numerical
oracle (:func:`hf_model`, :func:`hf_greedy`).

Scripts in ``scripts/`` import this module; tests import it too (never a script).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from xllm_eplb.ipc.objects import clean
from xllm_eplb.testing.dist import free_port

#: the checkout this package runs from (scripts, configs)
ROOT = Path(__file__).resolve().parents[2]
#: a worker's process title contains this (``xllm-eplb:ep<rank>``)
WORKER_TITLE = "xllm-eplb:ep"
# the oracle and the checkpoints are local folders: never ask the Hub (set before a script
# imports transformers)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def engine_serves_checkpoints() -> bool:
    """True when this checkout's engine has the ``--model`` option (the HF-checkpoint loader)."""
    from xllm_eplb.config import ModelConfig

    return "model" in ModelConfig.__dataclass_fields__


def wait_ready(proc: subprocess.Popen, out: Path, timeout: float = 300.0) -> None:
    """Wait for ``xllm-eplb ready`` in the server's output file ``out``; RuntimeError with its
    tail if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "xllm-eplb ready" in out.read_text():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise RuntimeError(f"server not ready: {out.read_text()[-2000:]}")


# --- the server ----------------------------------------------------------------------------

def shm_objects(run_id: str) -> list[str]:
    """This run's /dev/shm objects (names containing ``xllm_eplb_<run_id>_``)."""
    return [n for n in os.listdir("/dev/shm") if f"xllm_eplb_{run_id}_" in n]


def last_error(server, wait_s: float = 10.0) -> str:
    """The launcher's error line (why the run stopped), from ``server``'s console output
    (``out``, and ``err`` when not None; a :class:`Server` or anything with ``proc``, ``out``,
    ``err``).

    NOTE: the client sees the port close when the engine exits; the launcher prints its line
    1-4 s later (it waits for the cause, then stops the others): wait up to ``wait_s`` for
    the launcher to exit first (a run that read the console at once: "(no error line)")."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(wait_s)
    text = server.out.read_text() + ("" if server.err is None else server.err.read_text())
    errs = [ln for ln in text.splitlines() if "error" in ln.lower()]
    return errs[-1][:400] if errs else "(no error line)"


def kill_run(proc: subprocess.Popen, alive) -> None:
    """SIGKILL the process group of ``proc``, then every pid ``alive()`` still lists (children
    that left the group), then reap ``proc``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    proc.wait(10)


class Server:
    """One real ``xllm-eplb serve`` process group in its own session, with its logs and every
    process it started; the one server harness of ``scripts/`` and the tests.

    Two ways to start one (both return at once; call :meth:`wait_ready` before requests):

    - ``Server(model, log_dir, flags, *, ep=4, src=ROOT)`` (the scripts):
      ``serve --ep-size EP [--model MODEL] --workload=none --run_id s<port> --log_dir
      log_dir *flags``; stdout and stderr both into ``log_dir.parent / f"{log_dir.name}.out"``
      (``err`` is None). ``src``: the source tree to run (another checkout's ``xllm_eplb``,
      e.g. a ``git archive`` of an older commit); ``model=None``: the flags say what to serve.
    - :meth:`launch` ``(tmp, args, base=None, *, cmd=None, cwd=ROOT, env=None, port=None)``
      (the tests): ``serve *base --port P --log_dir tmp/logs *args`` (``base`` default: 4 ranks
      of ``configs/eplb.yaml``), stdout and stderr in ``tmp/stdout.txt`` / ``tmp/stderr.txt``,
      ``log_dir`` = ``tmp/logs/latest``; ``cmd``: the whole command line instead (it must
      listen on ``port`` and log under ``cwd/logs``).

    :meth:`stop` is a clean stop (SIGTERM, SIGKILL after 60 s); :meth:`kill` SIGKILLs every
    process the run started and sweeps its /dev/shm objects (a test fixture's teardown). One
    of them always runs, even on failure.
    """

    def __init__(self, model: Path | None, log_dir: Path, flags: list[str], *, ep: int = 4,
                 src: Path = ROOT):
        port = free_port()
        cmd = [sys.executable, "-m", "xllm_eplb", "serve", "--ep-size", str(ep),
               *(["--model", str(model)] if model is not None else []), "--workload=none",
               "--port", str(port), "--run_id", f"s{port}", "--log_dir", str(log_dir), *flags]
        out = log_dir.parent / f"{log_dir.name}.out"
        out.parent.mkdir(parents=True, exist_ok=True)
        env = None if src == ROOT else dict(os.environ, PYTHONPATH=str(src))
        self._spawn(cmd, port=port, run_id=f"s{port}", log_dir=log_dir, log_root=log_dir,
                    out=out, err=None, cwd=src, env=env)

    @classmethod
    def launch(cls, tmp: Path, args: list[str], base: list[str] | None = None, *,
               cmd: list[str] | None = None, cwd: Path = ROOT, env: dict | None = None,
               port: int | None = None) -> "Server":
        """The tests' form (class doc); ``run_id`` = ``p<port>`` (serve's default)."""
        srv = cls.__new__(cls)
        port = port or free_port()
        log_root = tmp / "logs"
        if cmd is None:
            if base is None:
                base = ["--ep-size", "4", "--config", str(ROOT / "configs" / "eplb.yaml")]
            cmd = [sys.executable, "-m", "xllm_eplb", "serve", *base, "--port", str(port),
                   "--log_dir", str(log_root), *args]
        else:
            log_root = cwd / "logs"
        srv._spawn(cmd, port=port, run_id=f"p{port}", log_dir=log_root / "latest",
                   log_root=log_root, out=tmp / "stdout.txt", err=tmp / "stderr.txt", cwd=cwd,
                   env=env)
        return srv

    @classmethod
    def start(cls, model: Path | None, log_dir: Path, flags: list[str], *, ep: int = 4,
              timeout: float = 600.0, src: Path = ROOT) -> "Server":
        """A started server, ready for requests (:meth:`wait_ready`)."""
        srv = cls(model, log_dir, flags, ep=ep, src=src)
        srv.wait_ready(timeout)
        return srv

    def _spawn(self, cmd: list[str], *, port: int, run_id: str, log_dir: Path, log_root: Path,
               out: Path, err: Path | None, cwd: Path, env: dict | None) -> None:
        self.port, self.run_id, self.url = port, run_id, f"http://127.0.0.1:{port}"
        #: this run's own log folder; ``log_root``: the ``--log_dir`` it was given
        self.log_dir, self.log_root = log_dir, log_root
        self.out, self.err = out, err
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out.open("w"),
                                     stderr=subprocess.STDOUT if err is None else err.open("w"),
                                     start_new_session=True)
        #: every pid the run started that was seen (:meth:`note_children`)
        self.pids: set[int] = {self.proc.pid}

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until ``xllm-eplb ready`` (then the run's processes are noted); on failure the
        server is stopped and RuntimeError names the log folder and the output's tail."""
        try:
            wait_ready(self.proc, self.out, timeout)
        except RuntimeError as e:
            tail = "" if self.err is None else f"\nstderr: {self.err.read_text()[-3000:]}"
            self.stop()
            raise RuntimeError(f"{e} (rc={self.proc.poll()}, logs: {self.log_dir}){tail}") \
                from None
        self.note_children()

    def note_children(self) -> None:
        """Record every process now under the launcher (:attr:`pids`)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.pids |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}

    def alive(self) -> list[int]:
        """The recorded pids still running (zombies excluded)."""
        out = []
        for p in self.pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def procs(self) -> list[psutil.Process]:
        """The launcher and every process under it."""
        try:
            p = psutil.Process(self.proc.pid)
            return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def worker_pids(self) -> list[int]:
        return [p.pid for p in workers(self.proc.pid)]

    def get(self, path: str) -> dict:
        """GET ``path`` -> its JSON."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            c.request("GET", path)
            return json.loads(c.getresponse().read())
        finally:
            c.close()

    def status(self) -> dict:
        return self.get("/eplb/status")

    def complete(self, ids: list[int], max_tokens: int, *, ignore_eos: bool = True) -> list[int]:
        """Greedy completion of a token-id prompt -> the generated ids (RuntimeError on an
        error)."""
        got = complete(self.port, {"prompt_token_ids": ids, "max_tokens": max_tokens,
                                   "temperature": 0.0, "ignore_eos": ignore_eos,
                                   "return_token_ids": True}, timeout=600)
        if isinstance(got, str):
            raise RuntimeError(f"/v1/completions: {got}")
        return got

    def complete_all(self, prompts: list[list[int]], max_tokens: int, **kw) -> list[list[int]]:
        """All prompts at once (one client thread each), results in prompt order."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens, **kw), prompts))

    def stop(self) -> int:
        """SIGTERM the launcher (a clean stop); SIGKILL the whole group after 60 s. Returns
        the launcher's exit code (-9 when it had to be killed)."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        try:
            self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            return -9

    def kill(self) -> None:
        """SIGKILL every process the run started, wait for them (10 s at most), then remove
        the run's /dev/shm objects (forced: a dying child may still map one)."""
        self.note_children()
        kill_run(self.proc, self.alive)
        deadline = time.monotonic() + 10     # SIGKILLed children still hold the run's segments
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        clean(self.run_id, force=True)


# --- requests ------------------------------------------------------------------------------

def complete(port: int, body: dict, stream: bool = False,
             timeout: float = 300) -> list[int] | str:
    """Token ids of one completion (``body`` asks ``return_token_ids``), or an error string."""
    if stream:
        rec: dict = {}
        stream_completion(port, body, rec, timeout)
        return rec["error"] or rec["ids"]
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        if r.status != 200:
            return f"HTTP {r.status}: {raw[:200]!r}"
        return json.loads(raw)["choices"][0]["token_ids"]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        c.close()


def stream_completion(port: int, body: dict, rec: dict, timeout: float = 300) -> None:
    """One streamed completion into ``rec``: ``ids``, ``times`` (epoch s per token),
    ``status`` (HTTP), ``error`` ('' when none), ``done`` (``[DONE]`` seen)."""
    rec.update(ids=[], times=[], status=0, error="", done=False)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        rec["status"] = r.status
        if r.status != 200:
            rec["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
            return
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                rec["done"] = True
                break
            obj = json.loads(data)
            if "error" in obj:
                rec["error"] = str(obj["error"])[:300]
                return
            new = [i for ch in obj.get("choices", []) for i in ch.get("token_ids", [])]
            now = time.time()
            rec["ids"] += new
            rec["times"] += [now] * len(new)
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()


WORDS = ("the engine moves experts between ranks while requests keep flowing and every token "
         "stays the same as before the balancer ran").split()


def make_prompts(model_dir: Path, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of ``length`` ids for the checkpoint at ``model_dir``, topics by
    the built-in workload's Zipf(1.2) mix (``engine/workload.py``), seeded."""
    import numpy as np

    from xllm_eplb.engine.workload import TopicPrompts, zipf_probs

    tp = TopicPrompts.for_checkpoint(str(model_dir))
    rng = np.random.default_rng(seed)
    p = zipf_probs(tp.num_topics, 1.2)
    return [tp.prompt(int(rng.choice(tp.num_topics, p=p)), length, rng) for _ in range(n)]


def prompt_pool(n: int = 12) -> list[dict]:
    """Fixed request bodies: short/long prompts, greedy (control) and seeded-sampled."""
    rng = random.Random(17)
    pool = []
    for i in range(n):
        long = i % 3 == 0
        words = [rng.choice(WORDS) for _ in range(rng.randint(40, 90) if long
                                                   else rng.randint(2, 8))]
        body = {"prompt": " ".join(words), "max_tokens": 48 if long else 12,
                "ignore_eos": True, "return_token_ids": True}
        body.update({"temperature": 0.0} if i % 2 == 0 else
                    {"temperature": 0.9, "seed": 100 + i, "top_k": 40})
        pool.append(body)
    return pool


class Clients:
    """``n`` threads, one request in flight each, drawing from ``pool`` (streamed or not,
    seeded per thread); every reply is compared with ``ref`` (the same bodies answered by a
    fault-free run). ``pause`` stops new requests and waits for those in flight."""

    def __init__(self, port: int, pool: list[dict], ref: list[list[int]], n: int):
        self.port, self.pool, self.ref = port, pool, ref
        self.lock = threading.Lock()
        self.ok = self.failed = self.mismatches = 0
        self.errors: list[str] = []
        self.stop, self.go = threading.Event(), threading.Event()
        self.idle = [threading.Event() for _ in range(n)]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(n)]

    def start(self) -> None:
        self.go.set()
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            if not self.go.is_set():
                self.idle[i].set()
                self.go.wait(0.2)
                continue
            self.idle[i].clear()
            k = rng.randrange(len(self.pool))
            got = complete(self.port, self.pool[k], stream=rng.random() < 0.5)
            with self.lock:
                if isinstance(got, str):
                    self.failed += 1
                    self.errors.append(got)
                else:
                    self.ok += 1
                    self.mismatches += got != self.ref[k]
        self.idle[i].set()

    def pause(self) -> None:
        self.go.clear()
        for e in self.idle:
            e.wait(300)

    def resume(self) -> None:
        for e in self.idle:
            e.clear()
        self.go.set()

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        for t in self.threads:
            t.join(300)


# --- killing ranks -------------------------------------------------------------------------

def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def workers(pid: int) -> list[psutil.Process]:
    """The worker processes under the serve process ``pid``."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in children if WORKER_TITLE in " ".join(_cmdline(p))]


def kill_worker(server, rng: random.Random) -> float:
    """SIGKILL a random worker of ``server`` (anything with the serve process as ``proc``);
    returns the kill time (epoch seconds)."""
    victim = rng.choice(workers(server.proc.pid))
    t = time.time()
    victim.kill()
    return t


def elastic_flags(model: Path) -> list[str]:
    """``--elastic_ep=true`` with the least redundancy that survives one loss at EP4."""
    cfg = json.loads((model / "config.json").read_text())
    e = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"])
    need = max(1, -(-e // 3) - e // 4)
    return ["--elastic_ep=true", f"--redundant_experts_num={need}",
            "--elastic_max_restarts=100000", "--elastic_silence_seconds=5"]


class Chaos:
    """SIGKILL a random worker of ``server`` every ``every`` seconds (seeded) until
    :meth:`close`; ``kills``: (epoch time, the victim's command line)."""

    def __init__(self, server, every: float, seed: int = 23):
        self.s, self.every, self.rng = server, every, random.Random(seed)
        self.kills: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            found = workers(self.s.proc.pid)
            if found:
                p = self.rng.choice(found)
                self.kills.append((time.time(), " ".join(_cmdline(p))))
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


# --- the oracle ----------------------------------------------------------------------------

def hf_model(model_dir: Path, *, defaults: bool = False):
    """transformers' model of the folder in fp32: eager attention and experts (the oracle), or
    with ``defaults`` transformers' own choice (sdpa, grouped_mm experts: what a user runs,
    the speed baseline)."""
    import torch
    from transformers import AutoModelForCausalLM

    impl = {} if defaults else {"attn_implementation": "eager",
                                "experts_implementation": "eager"}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **impl).eval()


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, *,
              ignore_eos: bool = True, device: str = "cpu") -> list[list[int]]:
    """``generate`` greedy on equal-length prompts -> the new ids of each."""
    import torch

    ids = torch.tensor(prompts, device=device)
    kw = {"min_new_tokens": new_tokens} if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:].tolist()


def timed(fn, repeat: int):
    """(best seconds of ``repeat`` calls of ``fn``, the last call's result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def write_json(path: Path | None, payload: dict) -> None:
    """A script's ``--json PATH`` output (nothing when ``path`` is None)."""
    if path:
        path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}")
