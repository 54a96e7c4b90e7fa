"""Shared pieces of the black-box fault tests (issue #17): a small checkpoint, the fault-free
reference tokens (the engine's own model in one process, every expert local), a greedy client
that keeps requests flowing, and readers of the run's logs and /metrics. Everything is observed
from outside the server: logs, ``/eplb/status``, ``/metrics``, exit codes."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

#: greedy control prompts (token ids of the generated checkpoint's vocabulary) and their length
PROMPTS = [[5, 17, 300, 42, 8, 9], [7, 30, 11], [100, 200, 300, 400, 401, 402, 403, 404]]
N_NEW = 10


def flags(ckpt: Path, *extra: str) -> list[str]:
    """EP2 on the checkpoint, a rebalance round every second on the synthetic load, canary on."""
    return ["--ep-size", "2", "--model", str(ckpt), "--eplb_update_interval=1",
            "--eplb_min_peak_load_improvement=0", "--eplb_canary=true",
            "--workload=synthetic", "--workload_rate=12", "--workload_prompt_len=8",
            "--workload_output_len=12", "--enable_fault_injection=true",
            # the tests need layers to move every round: xLLM's full re-plan on token counts
            "--eplb_policy_kind=balanced", "--eplb_plan_on=tokens", *extra]


def reference_tokens(ckpt: Path) -> list[list[int]]:
    """Greedy tokens of :data:`PROMPTS` on the single-process model (the fault-free run)."""
    from hf_parity_util import generate, one_thread

    from xllm_eplb.flags import load_config
    from xllm_eplb.model.decoder import Decoder

    cfg, _ = load_config(["--ep-size", "2", "--model", str(ckpt)])
    with one_thread():
        out = generate(Decoder.reference(cfg), list(enumerate(PROMPTS)), N_NEW)
    return [out[i][0] for i in range(len(PROMPTS))]


def post(url: str, body: dict, timeout: float = 30.0) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read()[:300].decode(errors="replace")}
    except (OSError, ValueError) as e:
        return -1, {"error": f"{type(e).__name__}: {e}"}


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


class Traffic:
    """One client thread sending the greedy control prompts in turn until :meth:`stop`;
    ``results``: (prompt index, HTTP status or -1, token ids or None, start epoch seconds)."""

    def __init__(self, url: str):
        self.url, self.results = url, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            k = i % len(PROMPTS)
            t0 = time.time()
            code, body = post(self.url, {"prompt": PROMPTS[k], "max_tokens": N_NEW,
                                         "temperature": 0.0, "ignore_eos": True,
                                         "return_token_ids": True})
            toks = body["choices"][0]["token_ids"] if code == 200 else None
            self.results.append((k, code, toks, t0))
            i += 1
            if code != 200:
                time.sleep(0.2)

    def stop(self) -> "Traffic":
        self._stop.set()
        self._t.join(60)
        return self

    def check(self, ref: list[list[int]], until: float = float("inf")) -> tuple[int, int]:
        """(ok, failed among the requests started before ``until``, e.g. the run's exit);
        every completed request's tokens equal the reference."""
        ok = [(k, t) for k, c, t, _ in self.results if c == 200]
        bad = [(k, t, ref[k]) for k, t in ok if t != ref[k]]
        assert not bad, f"tokens differ from the fault-free run: {bad[:3]}"
        return len(ok), sum(1 for _, c, _, t0 in self.results if c != 200 and t0 < until)


def log_lines(path: Path, needle: str) -> list[tuple[float, str]]:
    """(epoch seconds, line) of every line of ``path`` containing ``needle``."""
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        if needle in ln:
            out.append((datetime.strptime(ln.split()[0], "%Y-%m-%dT%H:%M:%S.%f").timestamp(),
                        ln))
    return out


def wait_for(pred, timeout: float, what: str, server=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if server is not None and server.proc.poll() is not None:
            raise AssertionError(f"server exited rc={server.proc.poll()} while waiting for "
                                 f"{what}: {server.err.read_text()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def scrape(url: str) -> str:
    """One read of ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def metric(url: str, name: str, *, text: str | None = None, **labels) -> float:
    """Sum of the samples of ``name`` with these labels in ``/metrics`` (``text``: one scrape
    already read, so that several values come from the same instant)."""
    text = scrape(url) if text is None else text
    return sum(x.value for fam in text_string_to_metric_families(text) for x in fam.samples
               if x.name == name and all(x.labels.get(k) == v for k, v in labels.items()))


def activations(log_dir: Path, ranks: int) -> tuple[dict, list[dict]]:
    """Per layer: engine commits (``EPLB layer activated``) and, per rank, activations
    (``update_expert_weight``) -- the counts must agree (no rank runs a partial layer)."""
    def count(path: Path, needle: str) -> dict[int, int]:
        c: dict[int, int] = {}
        for _, ln in log_lines(path, needle):
            layer = int(ln.split(" layer=")[1].split()[0])
            c[layer] = c.get(layer, 0) + 1
        return c

    return (count(log_dir / "engine.log", "EPLB layer activated"),
            [count(log_dir / f"rank{r}.log", " update_expert_weight ") for r in range(ranks)])


def outcome(kind: str, **figures) -> None:
    """One measured outcome line (``pytest -s`` shows them; docs/benchmarks.md quotes them)."""
    print("fault-outcome " + " ".join([f"kind={kind}"] + [
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()]),
        flush=True)
