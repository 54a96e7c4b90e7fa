"""Helpers shared by the scripts: a free port, waiting for a server's ready line, a real
``xllm-eplb serve --model DIR`` subprocess, completions by token ids (``bench_hf.py``,
``bench_memory.py``, ``demo_smollm2.py``; ``soak.py`` and ``bench_api.py`` take the first two),
and transformers' greedy generation (the oracle). Not a library module: scripts only."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def engine_serves_checkpoints() -> bool:
    """True when this checkout's engine has the ``--model`` option (the HF-checkpoint loader)."""
    from xllm_eplb.config import ModelConfig

    return "model" in ModelConfig.__dataclass_fields__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, out: Path, timeout: float = 300.0) -> None:
    """Wait for ``xllm-eplb ready`` in the server's stdout file ``out``; RuntimeError with its
    tail if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "xllm-eplb ready" in out.read_text():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise RuntimeError(f"server not ready: {out.read_text()[-2000:]}")


class Server:
    """``xllm-eplb serve --model DIR --ep-size EP`` in its own session; ``stop()`` ends it.
    ``root``: the source tree whose engine runs (default this one; another checkout's for a
    before/after comparison in one run)."""

    def __init__(self, model_dir: Path, ep: int, flags: list[str], log_dir: Path,
                 timeout: float = 600.0, root: Path = ROOT):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.out = log_dir / "stdout.txt"
        cmd = [sys.executable, "-m", "xllm_eplb", "serve", "--model", str(model_dir),
               "--ep-size", str(ep), "--port", str(self.port), "--log_dir", str(log_dir),
               "--workload=none", *flags]
        env = dict(os.environ, PYTHONPATH=str(root)) if root != ROOT else None
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.out.open("w"),
                                     stderr=(log_dir / "stderr.txt").open("w"),
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while "xllm-eplb ready" not in self.out.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = (log_dir / "stderr.txt").read_text()[-2000:]
                self.stop()
                raise RuntimeError(f"server did not start (see {log_dir}):\n{err}")
            time.sleep(0.3)

    def worker_pids(self) -> list[int]:
        import psutil

        return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "xllm-eplb:ep" in " ".join(p.cmdline())]

    def status(self) -> dict:
        with urllib.request.urlopen(self.url + "/eplb/status", timeout=30) as r:
            return json.loads(r.read())

    def complete(self, ids: list[int], max_tokens: int, *, ignore_eos: bool = True) -> list[int]:
        """Greedy completion of a token-id prompt -> the generated ids."""
        body = {"prompt_token_ids": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": ignore_eos, "return_token_ids": True}
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"/v1/completions: {e.code} {e.read()[:300]!r}") from None
        return list(out["choices"][0]["token_ids"])

    def complete_all(self, prompts: list[list[int]], max_tokens: int, **kw) -> list[list[int]]:
        """All prompts at once (one client thread each), results in prompt order."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens, **kw), prompts))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


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


def write_json(path: Path | None, payload: dict) -> None:
    if path:
        path.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}")
