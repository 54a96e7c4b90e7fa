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

Arrivals (as ``vllm bench serve``): ``--request-rate`` requests per second (default ``inf``: all
at once, ``--concurrency`` in flight), with gamma-distributed gaps of shape ``--burstiness``
(1 = Poisson; < 1 burstier, > 1 more regular; mean gap ``1 / rate`` either way), seeded by
``--seed``; ``--concurrency`` still caps the requests in flight.

Reported (seconds): request throughput, output tokens/s, TTFT (arrival of the first token),
TPOT ((E2E - TTFT) / (tokens - 1) per request), ITL (gap between consecutive token-carrying
chunks) and E2E latency, each as mean, P50, P90 and P99. A table on stdout, headed by what the
server said about itself before the run (``/v1/models``, ``/eplb/status``: model, EP size, EPLB
policy, the built-in workload) and ended by an EPLB section read from ``/eplb/status`` before and
after the run (:mod:`~xllm_eplb.commands.bench_eplb`: MoE critical path, balancedness, slots
moved, the modelled gain); ``--compare URL2``: the same load against two servers, alternately,
one side-by-side table; ``--json PATH`` writes every number.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import numpy as np

from xllm_eplb.cli import handle_user_errors
from xllm_eplb.commands import bench_eplb
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


def workload_warning(status: dict) -> str | None:
    """One warning line when the server runs its built-in synthetic workload (``status``: its
    ``/eplb/status``, whose ``workload`` is ``{"kind": ..., "rate_per_s": ...}``): those
    requests share the engine with the measured ones, so every number is lower than the server
    can give. None otherwise (or unknown)."""
    w = status.get("workload")
    kind = w.get("kind", "none") if isinstance(w, dict) else "none"
    if kind == "none":
        return None
    return (f"warning: the server runs the built-in {kind} workload "
            f"({w.get('rate_per_s', '?')} req/s): it shares the engine with these requests, "
            f"so the numbers below understate the server (serve with --workload=none to measure "
            f"it alone)")


def auth_headers(api_key: str = "") -> dict:
    """The JSON content type, plus the bearer token of a server started with ``--api-key``."""
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def stream_one(host: str, port: int, body: dict, timeout: float, api_key: str = "") -> dict:
    """One streamed completion: token arrival times (perf_counter), ids, or an error."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers=auth_headers(api_key))
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


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send offsets (seconds from the start, float64 [n], non-decreasing) of ``n`` requests at
    ``rate`` per second: gaps drawn from a gamma law of shape ``burstiness`` and mean
    ``1 / rate`` (``burstiness=1``: a Poisson process), the first request at 0. ``rate=inf``:
    every offset 0 (vLLM's ``--request-rate inf``)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def run_bench(url: str, prompts: list, max_tokens: int, concurrency: int,
              seed: int = 0, timeout: float = 600.0, *, request_rate: float = math.inf,
              burstiness: float = 1.0, api_key: str = "") -> dict:
    """Send every prompt (token ids or text) as a streamed request, request ``i`` not before
    ``arrival_times(...)[i]`` and at most ``concurrency`` in flight; returns the numbers
    and the generated token ids per prompt (``outputs``, None if failed). A request that waits
    for a free slot is timed from when it is sent."""
    host, port = check_url(url)
    results: list = [None] * len(prompts)
    lock = threading.Lock()
    at = arrival_times(len(prompts), request_rate, burstiness, seed)

    def one(i: int) -> None:
        p = prompts[i]
        body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "seed": seed + i,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        try:
            res = stream_one(host, port, body, timeout, api_key)
        except (OSError, http.client.HTTPException, ValueError) as e:
            res = {"error": f"{type(e).__name__}: {e}"}
        with lock:
            results[i] = res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        slots = threading.Semaphore(concurrency)    # submit only when a client thread is free

        def done(_f) -> None:
            slots.release()

        for i in range(len(prompts)):
            wait = t0 + at[i] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            slots.acquire()
            pool.submit(one, i).add_done_callback(done)
    out = summarize(results, time.perf_counter() - t0)
    out.update(request_rate=request_rate, burstiness=burstiness, concurrency=concurrency)
    return out


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


def server_info(url: str, timeout: float = 10.0, api_key: str = "") -> dict:
    """What the server says about itself: ``{"model": /v1/models' first entry, "status":
    /eplb/status}``; a part the server does not answer (another engine) is left out."""
    import urllib.request

    out: dict = {}
    for key, path in (("model", "/v1/models"), ("status", "/eplb/status")):
        try:
            req = urllib.request.Request(url.rstrip("/") + path, headers=auth_headers(api_key))
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = json.loads(r.read())
        except (OSError, ValueError):
            continue
        if key == "model":
            data = body.get("data") if isinstance(body, dict) else None
            if data and isinstance(data[0], dict):
                out[key] = data[0]
        elif isinstance(body, dict):
            body.pop("placement", None)          # [layers][slots]: not a header's business
            out[key] = body
    return out


def _workload_text(w) -> str:
    """``/eplb/status``'s ``workload`` -> ``synthetic rate=8/s prompt=32 output=64 ...``."""
    if not isinstance(w, dict):
        return "unknown (the server does not report it)"
    kind = w.get("kind", "?")
    rest = " ".join(f"{k}={v}" for k, v in w.items() if k != "kind")
    return f"{kind} {rest}".strip()


def header_rows(url: str, info: dict, res: dict) -> list[tuple[str, str]]:
    """The table's header: the server and the run's shape."""
    rows = [("Server", url)]
    m, st = info.get("model"), info.get("status")
    if m:
        rows.append(("Model", f"{m.get('id')} (max_model_len {m.get('max_model_len', '?')})"))
    if st:
        eplb = (f"on, policy={st.get('policy')}, placement_epoch={st.get('placement_epoch')}"
                if st.get("enabled") else "off")
        rows += [("EP size", str(st.get("ep_size"))), ("EPLB", eplb),
                 ("Server workload", _workload_text(st.get("workload")))]
        # NOTE: the balancedness before the run is in the EPLB section, beside the initial and
        # the final one (a header figure of its own read as contradicting them)
    else:
        rows.append(("Server state", "no /eplb/status (not an xllm-eplb server?)"))
    rate = res["request_rate"]
    rows += [("Request rate (req/s)", "inf" if math.isinf(rate) else f"{rate:g}"),
             ("Burstiness", f"{res['burstiness']:g}"), ("Max concurrency", str(res["concurrency"]))]
    return rows


def table(url: str, info: dict, r: dict, width: int = 60, eplb: list | None = None) -> str:
    """The readable report (``vllm bench serve``'s layout): header, totals, latencies in ms;
    ``eplb``: the EPLB section's rows (:func:`~xllm_eplb.commands.bench_eplb.eplb_rows`)."""
    def row(k: str, v) -> str:
        return f"{k + ':':<34}{v}"

    lines = [" xllm-eplb bench ".center(width, "="),
             *(row(k, v) for k, v in header_rows(url, info, r)),
             " Result ".center(width, "-"),
             row("Successful requests", r["ok"]), row("Failed requests", r["errors"]),
             row("Benchmark duration (s)", f"{r['seconds']:.2f}"),
             row("Output tokens", r["output_tokens"]),
             row("Request throughput (req/s)", f"{r['req_per_s']:.2f}"),
             row("Output token throughput (tok/s)", f"{r['tokens_per_s']:.1f}"),
             " Latency (ms) ".center(width, "-"),
             f"{'':<8}" + "".join(f"{h:>13}" for h in ("mean", "p50", "p90", "p99"))]
    for k in STATS:
        vals = [r[f"{k}_{s}_s"] * 1e3 for s in ("mean", "p50", "p90", "p99")]
        lines.append(f"{k.upper():<8}" + "".join(f"{v:>13.2f}" for v in vals))
    if eplb:
        lines.append(" EPLB (server's /eplb/status, this run) ".center(width, "-"))
        lines += [row(k, v) for k, v in eplb]
    lines.append("=" * width)
    return "\n".join(lines)


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
@click.option("--request-rate", "--request_rate", type=click.FloatRange(0, min_open=True),
              default=math.inf, show_default=True,
              help="requests per second (gamma/Poisson arrivals); inf: all at once")
@click.option("--burstiness", type=click.FloatRange(0, min_open=True), default=1.0,
              show_default=True, help="shape of the gamma law of the gaps between arrivals: "
              "1 = Poisson, < 1 burstier, > 1 more regular (needs a finite --request-rate)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--api-key", "--api_key", default="",
              help="bearer token of a server started with --api-key (as the openai client's)")
@click.option("--compare", "url_b", default=None,
              help="a second server (e.g. the same model with --enable_eplb=false): the same "
              "requests against both, alternately, and one side-by-side table")
@click.option("--pairs", type=click.IntRange(1), default=3, show_default=True,
              help="--compare: runs per server (alternated A B, B A, ...)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="also write the numbers to this JSON file")
@handle_user_errors
def bench(url, n, concurrency, prompt_len, max_tokens, topics, skew, dataset, max_prompt_chars,
          request_rate, burstiness, seed, api_key, url_b, pairs, json_path) -> None:
    """Drive a running server (streaming) and report throughput, TTFT, TPOT, ITL and E2E, then
    what EPLB did during the run (MoE critical path, balancedness, slots moved, modelled gain)."""
    check_url(url)
    if url_b:
        check_url(url_b)
    if json_path and not (Path(json_path).parent.is_dir()):
        raise UserError(f"--json={json_path}: folder {Path(json_path).parent} does not exist")
    if burstiness != 1.0 and math.isinf(request_rate):
        raise UserError(f"--burstiness={burstiness:g}: needs a finite --request-rate (with "
                        f"--request-rate=inf every request is sent at once)")
    prompts = (sharegpt_prompts(dataset, n, seed, max_prompt_chars) if dataset
               else make_prompts(n, prompt_len, topics, skew, seed))

    def measured(u: str) -> tuple[dict, dict, dict]:
        """(run_bench numbers, status before, status after) of one run against ``u``."""
        before = server_info(u, api_key=api_key)
        warn = workload_warning(before.get("status", {}))
        if warn:
            click.echo(warn, err=True)
        r = run_bench(u, prompts, max_tokens, concurrency, seed, request_rate=request_rate,
                      burstiness=burstiness, api_key=api_key)
        r.pop("outputs")
        if r["ok"] == 0 and r["errors"]:
            raise UserError(f"--url={u}: every request failed; first error: "
                            f"{r['first_error']}")
        if r["errors"]:
            click.echo(f"{u}: first error: {r['first_error']}", err=True)
        return r, before, server_info(u, api_key=api_key)

    if url_b:
        _compare(url, url_b, pairs, measured, json_path)
        return
    res, info, after = measured(url)
    eplb = None
    if "status" in info and "status" in after:
        eplb = bench_eplb.eplb_numbers(info["status"], after["status"])
    click.echo(table(url, info, res, eplb=bench_eplb.eplb_rows(eplb) if eplb else None))
    for line in bench_eplb.eplb_notes(eplb) if eplb else []:
        click.echo(line)
    if json_path:
        res["request_rate"] = "inf" if math.isinf(request_rate) else request_rate
        res["server"] = info
        res["eplb"] = eplb
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)


def _compare(url_a: str, url_b: str, pairs: int, measured, json_path: str | None) -> None:
    """``bench --compare``: alternate runs, one table (``measured(url)``: one run's numbers)."""
    def one(u: str):
        def run() -> dict:
            r, s0, s1 = measured(u)
            if "status" not in s0 or "status" not in s1:
                raise UserError(f"--compare: {u} has no /eplb/status (not an xllm-eplb server)")
            return bench_eplb.run_numbers(r, s0["status"], s1["status"])
        return run

    rounds = bench_eplb.compare(one(url_a), one(url_b), pairs)
    click.echo(bench_eplb.compare_table(url_a, url_b, rounds))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"a": url_a, "b": url_b, "pairs": [{"a": a, "b": b} for a, b in rounds]},
                      f, indent=2)
