"""``xllm-eplb bench --url URL``: drive a running server, report throughput and latency.

Sends ``--requests`` completions from ``--concurrency`` client threads. Prompts are byte tokens
of topics drawn Zipf(``--skew``) (token ``b`` belongs to topic ``b % --topics``, as in
:mod:`xllm_eplb.model.topics`), so the load is skewed like the built-in workload; temperature 0
and ``ignore_eos`` make every request produce exactly ``--max-tokens`` tokens.

Prints one line ``bench requests=.. ok=.. errors=.. seconds=.. req_per_s=.. tokens_per_s=..
p50_s=.. p99_s=..``; ``--json PATH`` writes the same numbers.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import numpy as np

from xllm_eplb.cli import handle_user_errors
from xllm_eplb.errors import UserError


def post_json(url: str, body: dict, timeout: float = 600.0) -> tuple[int, dict]:
    """POST ``body`` as JSON; returns (HTTP status, decoded JSON body)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def make_prompts(n: int, prompt_len: int, topics: int, skew: float, seed: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` byte tokens, topic ranks drawn Zipf(``skew``)."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, topics + 1) ** skew
    out = []
    for t in rng.choice(topics, size=n, p=w / w.sum()):
        pool = np.arange(int(t), 256, topics)
        out.append([int(x) for x in rng.choice(pool, size=prompt_len)])
    return out


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run_bench(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
              seed: int = 0, timeout: float = 600.0) -> dict:
    """Send every prompt (``concurrency`` in flight); returns throughput/latency numbers and
    the generated token ids per prompt (``outputs``, None for a failed request)."""
    url = url.rstrip("/") + "/v1/completions"
    lat: list[float] = []
    outputs: list = [None] * len(prompts)
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            code, body = post_json(url, {"prompt_token_ids": prompts[i], "max_tokens": max_tokens,
                                         "temperature": 0.0, "seed": seed + i,
                                         "ignore_eos": True}, timeout)
        except OSError as e:
            code, body = 0, {"error": {"message": str(e)}}
        dt = time.perf_counter() - t0
        with lock:
            if code == 200:
                lat.append(dt)
                outputs[i] = body["choices"][0]["token_ids"]
            else:
                errors.append(f"{code}: {body.get('error', {}).get('message', body)}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(len(prompts))))
    secs = time.perf_counter() - t0
    toks = sum(len(o) for o in outputs if o)
    return {"requests": len(prompts), "ok": len(lat), "errors": len(errors),
            "first_error": errors[0] if errors else "", "seconds": secs,
            "req_per_s": len(lat) / secs, "tokens_per_s": toks / secs,
            "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99), "outputs": outputs}


def summary_line(r: dict) -> str:
    keys = ("requests", "ok", "errors", "seconds", "req_per_s", "tokens_per_s", "p50_s", "p99_s")
    return "bench " + " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}"
                               for k in keys)


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
@click.option("--requests", "n", type=click.IntRange(1), default=64, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=16, show_default=True)
@click.option("--prompt-len", "--prompt_len", type=click.IntRange(1), default=32,
              show_default=True, help="prompt tokens")
@click.option("--max-tokens", "--max_tokens", type=click.IntRange(1), default=32,
              show_default=True, help="output tokens per request")
@click.option("--topics", type=click.IntRange(1, 256), default=16, show_default=True)
@click.option("--skew", type=click.FloatRange(0), default=1.2, show_default=True,
              help="Zipf exponent of the topic mix")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="also write the numbers to this JSON file")
@handle_user_errors
def bench(url, n, concurrency, prompt_len, max_tokens, topics, skew, seed, json_path) -> None:
    """Drive a running server and report throughput and P50/P99 latency."""
    if json_path and not (Path(json_path).parent.is_dir()):
        raise UserError(f"--json={json_path}: folder {Path(json_path).parent} does not exist")
    prompts = make_prompts(n, prompt_len, topics, skew, seed)
    try:
        res = run_bench(url, prompts, max_tokens, concurrency, seed)
    except Exception as e:  # noqa: BLE001 - one line, exit 2
        raise UserError(f"--url={url}: {e}") from None
    res.pop("outputs")
    click.echo(summary_line(res))
    if res["errors"]:
        click.echo(f"first error: {res['first_error']}", err=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    if res["ok"] == 0:
        raise SystemExit(1)
