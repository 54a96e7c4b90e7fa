"""``xllm-eplb bench --url URL``: drive a running server over streaming completions and report
what ``vllm bench serve`` users read.

Sends ``--requests`` streamed ``/v1/completions`` from ``--concurrency`` client threads (one
keep-alive-free HTTP connection per request, ``return_token_ids`` on, so every token is counted
when it arrives). Prompts: by default seeded synthetic prompts of token ids 0..255 whose topics
are drawn Zipf(``--skew``) (token ``b`` belongs to topic ``b % --topics``, the rule of the
generated checkpoints, see :mod:`xllm_eplb.model.checkpoint`), so the load is skewed like the
built-in workload; or the first
human turn of each conversation of a ShareGPT-format JSON file (``--dataset``). Temperature 0
and ``ignore_eos`` make every request produce exactly ``--max-tokens`` tokens.

Reported (seconds): request throughput, output tokens/s, TTFT (arrival of the first token),
TPOT ((E2E - TTFT) / (tokens - 1) per request), ITL (gap between consecutive token-carrying
chunks) and E2E latency, each as mean, P50, P90 and P99. One line on stdout; ``--json PATH``
writes every number.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import numpy as np

from xllm_eplb.cli import handle_user_errors
from xllm_eplb.errors import UserError

STATS = ("ttft", "tpot", "itl", "e2e")


def make_prompts(n: int, prompt_len: int, topics: int, skew: float, seed: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` byte tokens, topic ranks drawn Zipf(``skew``)."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, topics + 1) ** skew
    out = []
    for t in rng.choice(topics, size=n, p=w / w.sum()):
        pool = np.arange(int(t), 256, topics)
        out.append([int(x) for x in rng.choice(pool, size=prompt_len)])
    return out


def sharegpt_prompts(path: str, n: int, seed: int, max_chars: int) -> list[str]:
    """``n`` prompts (first human turn, at most ``max_chars`` characters; shuffled with
    ``seed``, repeated when the file has fewer) from a ShareGPT-format JSON file: a list of
    ``{"conversations": [{"from": "human", "value": ...}, ...]}``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"--dataset={path}: cannot read a JSON file ({e})") from None
    texts = []
    for conv in data if isinstance(data, list) else []:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        first = next((t.get("value") for t in turns or [] if isinstance(t, dict)
                      and t.get("from") in ("human", "user")), None)
        if isinstance(first, str) and 0 < len(first) <= max_chars:
            texts.append(first)
    if not texts:
        raise UserError(f"--dataset={path}: no conversation with a human turn of 1.."
                        f"{max_chars} characters (ShareGPT format: a list of "
                        f"{{'conversations': [{{'from': 'human', 'value': ...}}]}})")
    order = np.random.default_rng(seed).permutation(len(texts))
    return [texts[order[i % len(texts)]] for i in range(n)]


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def check_url(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise UserError(f"--url={url}: unknown url type (want http://HOST:PORT)")
    return u.hostname, u.port or 80


def workload_warning(url: str, timeout: float = 5.0) -> str | None:
    """One warning line when the server at ``url`` runs its built-in synthetic workload (its
    ``/eplb/status`` ``workload`` field): those requests share the engine with the measured
    ones, so every number is lower than the server can give. None otherwise (or unknown)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/eplb/status", timeout=timeout) as r:
            st = json.loads(r.read())
    except (OSError, ValueError):
        return None
    kind = st.get("workload", "none")
    if kind in (None, "none"):
        return None
    return (f"warning: the server runs the built-in {kind} workload "
            f"({st.get('workload_rate', '?')} req/s): it shares the engine with these requests, "
            f"so the numbers below understate the server (serve with --workload=none to measure "
            f"it alone)")


def stream_one(host: str, port: int, body: dict, timeout: float) -> dict:
    """One streamed completion: token arrival times (perf_counter), ids, or an error."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raw = r.read()
            try:
                msg = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = raw[:200].decode(errors="replace")
            return {"error": f"{r.status}: {msg}"}
        times, ids = [], []
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                return {"error": obj["error"].get("message", str(obj))}
            new = [i for c in obj.get("choices", []) for i in c.get("token_ids", [])]
            if new:
                times.append(time.perf_counter() - t0)
                ids.extend(new)
        return {"times": times, "ids": ids, "e2e": time.perf_counter() - t0}
    finally:
        conn.close()


def run_bench(url: str, prompts: list, max_tokens: int, concurrency: int,
              seed: int = 0, timeout: float = 600.0) -> dict:
    """Send every prompt (token ids or text; ``concurrency`` in flight) as a streamed request;
    returns the numbers and the generated token ids per prompt (``outputs``, None if failed)."""
    host, port = check_url(url)
    results: list = [None] * len(prompts)
    lock = threading.Lock()

    def one(i: int) -> None:
        p = prompts[i]
        body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "seed": seed + i,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        try:
            res = stream_one(host, port, body, timeout)
        except (OSError, http.client.HTTPException, ValueError) as e:
            res = {"error": f"{type(e).__name__}: {e}"}
        with lock:
            results[i] = res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(len(prompts))))
    return summarize(results, time.perf_counter() - t0)


def summarize(results: list[dict], secs: float) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    lat = {k: [] for k in STATS}
    for r in ok:
        t, n = r["times"], len(r["ids"])
        if t:
            lat["ttft"].append(t[0])
            lat["itl"].extend(np.diff(t).tolist())
        if n > 1 and t:
            lat["tpot"].append((r["e2e"] - t[0]) / (n - 1))
        lat["e2e"].append(r["e2e"])
    toks = sum(len(r["ids"]) for r in ok)
    out = {"requests": len(results), "ok": len(ok), "errors": len(errors),
           "first_error": errors[0] if errors else "", "seconds": secs,
           "req_per_s": len(ok) / secs, "tokens_per_s": toks / secs, "output_tokens": toks}
    for k in STATS:
        xs = lat[k]
        out[f"{k}_mean_s"] = float(np.mean(xs)) if xs else float("nan")
        for q in (50, 90, 99):
            out[f"{k}_p{q}_s"] = percentile(xs, q)
    out["p50_s"], out["p99_s"] = out["e2e_p50_s"], out["e2e_p99_s"]
    out["outputs"] = [None if "error" in r else r["ids"] for r in results]
    return out


def summary_line(r: dict) -> str:
    keys = ["requests", "ok", "errors", "seconds", "req_per_s", "tokens_per_s"]
    keys += [f"{k}_{s}_s" for k in STATS for s in ("mean", "p50", "p90", "p99")]
    return "bench " + " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}"
                               for k in keys)


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
@click.option("--requests", "n", type=click.IntRange(1), default=64, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=16, show_default=True)
@click.option("--prompt-len", "--prompt_len", type=click.IntRange(1), default=32,
              show_default=True, help="synthetic prompts: tokens")
@click.option("--max-tokens", "--max_tokens", type=click.IntRange(1), default=32,
              show_default=True, help="output tokens per request")
@click.option("--topics", type=click.IntRange(1, 256), default=16, show_default=True)
@click.option("--skew", type=click.FloatRange(0), default=1.2, show_default=True,
              help="Zipf exponent of the topic mix")
@click.option("--dataset", type=str, default=None,
              help="ShareGPT-format JSON file: prompts are each conversation's first human turn")
@click.option("--max-prompt-chars", type=click.IntRange(1), default=400, show_default=True,
              help="--dataset: skip longer prompts")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="also write the numbers to this JSON file")
@handle_user_errors
def bench(url, n, concurrency, prompt_len, max_tokens, topics, skew, dataset, max_prompt_chars,
          seed, json_path) -> None:
    """Drive a running server (streaming) and report throughput, TTFT, TPOT, ITL and E2E."""
    check_url(url)
    if json_path and not (Path(json_path).parent.is_dir()):
        raise UserError(f"--json={json_path}: folder {Path(json_path).parent} does not exist")
    prompts = (sharegpt_prompts(dataset, n, seed, max_prompt_chars) if dataset
               else make_prompts(n, prompt_len, topics, skew, seed))
    warn = workload_warning(url)
    if warn:
        click.echo(warn, err=True)
    res = run_bench(url, prompts, max_tokens, concurrency, seed)
    res.pop("outputs")
    if res["ok"] == 0 and res["errors"]:
        raise UserError(f"--url={url}: every request failed; first error: {res['first_error']}")
    click.echo(summary_line(res))
    if res["errors"]:
        click.echo(f"first error: {res['first_error']}", err=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
