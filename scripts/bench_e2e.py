#!/usr/bin/env python3
"""End-to-end EPLB gain: off / on / on-with-no-move alternated in one run, each rank on its own
core, a compute-heavy generated checkpoint with routing skew.

Set-up: ``xllm-eplb make-checkpoint`` writes a qwen3_moe checkpoint (``--hidden``,
``--moe-width``, ``--experts``, ``--top-k``, ``--layers``, ``--routing-skew``). One real
``xllm-eplb serve --ep-size 2 --worker_cpu_affinity=0,1`` per mode runs on it, all started
before measuring (an idle server costs nothing):

- ``off``: ``--enable_eplb=false`` (the initial placement, the static imbalance);
- ``on``: EPLB on, the defaults (``incremental``, ``--eplb_plan_on=cost``) with a 2 s interval;
- ``nomove``: EPLB on with ``--eplb_min_peak_load_improvement=1`` (nothing is ever published:
  the cost of counting, modelling and planning alone);
- ``tokens`` (``--tokens``): EPLB on with ``--eplb_plan_on=tokens`` (the split-cost case).

Every server is warmed up (EPLB modes until the cost model is fitted and, for ``on``, until its
rounds stop moving layers), then ``--pairs`` rounds each drive every server with the same
requests (``xllm-eplb bench`` logic: Zipf-skewed topic prompts, temperature 0, fixed lengths),
the mode order reversed every other round. Per mode and round (deltas of ``/eplb/status``):

- wall clock: output tokens/s and TPOT (mean, seconds per token after the first);
- critical path from worker timings: per decode step, the sum over MoE layers of the slowest
  rank's expert CPU seconds (``time.thread_time``), and the mean rank's; their ratio is the
  imbalance (``off``: the static imbalance);
- perfect balance: the off step with its critical path replaced by the mean rank's,
  ``gain_perfect = tpot_off / (tpot_off - (crit_off - mean_off)) - 1``; measured
  ``gain = tokens/s on / tokens/s off - 1`` in the same round; on the critical path,
  ``critical_gain_perfect = crit_off / mean_off - 1`` against ``crit_off / crit_on - 1``
  (``critical_gain_over_perfect``: the share of perfect balance reached);
- the cost model (``/eplb/status`` ``cost_model`` of the ``on`` server): its predicted
  critical path under the initial and the deployed placement; predicted wall-clock gain =
  ``tpot_off / (tpot_off - (pred_initial - pred_deployed)) - 1`` against the measured gain,
  and predicted critical-path gain against ``crit_off / crit_on - 1``; and the ``on``
  server's own post-commit checks (``commit_checks``: per committed layer, the measured gain of
  the steps just after vs just before the commit, on the same server, and the predicted one).

With 2 cores and EP2 the engine shares a core with the ranks: wall-clock numbers include that,
the critical path does not (it is each rank's own CPU time). ``--project`` replays the
DeepSeek dumps (``../shared/data``) at EP16/EP32 through the simulator with the cost model this
run fitted (``xllm_eplb.sim.replay`` with ``ReplayOptions.cost``).

    python scripts/bench_e2e.py [--quick] [--json PATH] [--pairs N] [--tokens] [--project]

Prints a summary table (per-mode medians, per-round gains, the key numbers); ``--json PATH``
writes every number (per round, the cost model's fit, the commit checks) to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb.commands.bench import make_prompts, run_bench  # noqa: E402
from xllm_eplb.testing.serving import Server  # noqa: E402

MODES = {
    "off": ["--enable_eplb=false"],
    "on": ["--enable_eplb=true"],
    "nomove": ["--enable_eplb=true", "--eplb_min_peak_load_improvement=1"],
    "tokens": ["--enable_eplb=true", "--eplb_plan_on=tokens"],
}


def _mode_flags(args, mode: str) -> list[str]:
    return ["--worker_cpu_affinity=" + args.affinity, f"--max_batch_size={args.batch}",
            "--eplb_update_interval=2", "--redundant_experts_num=1", *MODES[mode]]


def make_ckpt(args, out: Path) -> Path:
    cmd = [sys.executable, "-m", "xllm_eplb", "make-checkpoint", "--arch", "qwen3_moe",
           "--out", str(out), "--hidden-size", str(args.hidden), "--moe-intermediate-size",
           str(args.moe_width), "--intermediate-size", str(args.moe_width), "--num-experts",
           str(args.experts), "--top-k", str(args.top_k), "--num-layers", str(args.layers),
           "--dense-layers", "0", "--routing-skew", str(args.routing_skew), "--num-heads", "8"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def status(srv) -> dict:
    return srv.status()


def warm(srv, mode: str, prompts, args) -> dict:
    """Drive ``srv`` until it is steady: the cost model fitted (EPLB modes) and, for modes that
    move layers, no layer committed during the last warm-up batch."""
    deadline = time.monotonic() + args.warm_seconds
    committed = -1
    while True:
        run_bench(srv.url, prompts, args.max_tokens, args.concurrency)
        st = status(srv)
        if mode == "off":
            return st
        ready = bool(st.get("cost_model", {}).get("ready"))
        steady = st["layers_committed"] == committed and not st["round_in_progress"]
        committed = st["layers_committed"]
        if (ready and (mode == "nomove" or steady)) or time.monotonic() > deadline:
            return st


def delta(a: dict, b: dict, key: str) -> float:
    return b["critical_path"].get(key, 0.0) - a["critical_path"].get(key, 0.0)


def measure(srv, prompts, args) -> dict:
    s0 = status(srv)
    res = run_bench(srv.url, prompts, args.max_tokens, args.concurrency)
    s1 = status(srv)
    dsteps = max(1.0, delta(s0, s1, "decode_steps"))
    crit = delta(s0, s1, "decode_critical_s") / dsteps
    mean = delta(s0, s1, "decode_expert_cpu_s") / dsteps / 2
    return {"tokens_per_s": res["tokens_per_s"], "tpot_s": res["tpot_mean_s"],
            "critical_ms_per_step": 1e3 * crit, "mean_rank_ms_per_step": 1e3 * mean,
            "imbalance": crit / mean if mean > 0 else float("nan"),
            "decode_steps": dsteps, "errors": res["errors"], "outputs": res["outputs"],
            "layers_committed": s1.get("layers_committed", 0),
            "layers_regressed": s1.get("layers_regressed", 0),
            "cost_model": s1.get("cost_model")}


def cost_checks(srv) -> list[dict]:
    """The server's post-commit checks (``EPLB layer cost check`` lines of engine.log): per
    committed layer the measured critical-path gain (same server, the steps just before vs just
    after the commit) and the one the cost model predicted."""
    out = []
    for line in (srv.log_dir / "latest" / "engine.log").read_text().splitlines():   # this run's folder
        if "EPLB layer cost check" not in line:
            continue
        kv = dict(f.split("=", 1) for f in line.split() if "=" in f)
        out.append({k: (None if kv[k] == "None" else json.loads(kv[k].lower()))
                    for k in ("layer", "measured_gain", "predicted_gain", "regressed")})
    return out


def pair_numbers(r: dict) -> dict:
    """Gains of one round (see the module doc)."""
    off, on = r["off"], r["on"]
    tpot, crit, mean = off["tpot_s"], off["critical_ms_per_step"] / 1e3, off[
        "mean_rank_ms_per_step"] / 1e3
    # the step time per output token: a decode step serves one token of every running request
    step = tpot
    out = {"gain": on["tokens_per_s"] / off["tokens_per_s"] - 1.0,
           "gain_perfect": step / (step - (crit - mean)) - 1.0 if step > crit - mean else None,
           "critical_path_gain": off["critical_ms_per_step"] / on["critical_ms_per_step"] - 1,
           # perfect balance on the critical path: off's slowest rank brought to its mean rank
           "critical_gain_perfect": crit / mean - 1.0 if mean > 0 else None,
           "tokens_identical": on["outputs"] == off["outputs"]}
    if out["critical_gain_perfect"]:
        out["critical_gain_over_perfect"] = (out["critical_path_gain"]
                                             / out["critical_gain_perfect"])
    cmod = on.get("cost_model") or {}
    if cmod.get("predicted_critical_s") and cmod.get("predicted_critical_initial_s"):
        dp = cmod["predicted_critical_initial_s"] - cmod["predicted_critical_s"]
        out["predicted_critical_path_gain"] = (cmod["predicted_critical_initial_s"]
                                               / cmod["predicted_critical_s"] - 1.0)
        out["predicted_gain"] = step / (step - dp) - 1.0
    for m in r:
        if m not in ("off", "on"):
            out[f"gain_{m}"] = r[m]["tokens_per_s"] / off["tokens_per_s"] - 1.0
            out[f"critical_path_ratio_{m}_off"] = (r[m]["critical_ms_per_step"]
                                                   / off["critical_ms_per_step"])
    return out


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def summarize(rounds: list[dict], modes: list[str]) -> dict:
    pairs = [pair_numbers(r) for r in rounds]
    per_mode = {m: {k: median([r[m][k] for r in rounds])
                    for k in ("tokens_per_s", "tpot_s", "critical_ms_per_step",
                              "mean_rank_ms_per_step", "imbalance")} for m in modes}
    out = {"per_mode_median": per_mode, "pairs": pairs,
           "static_imbalance": per_mode["off"]["imbalance"],
           "on_over_off_every_pair": all(p["gain"] >= 0 for p in pairs),
           "gain_median": median([p["gain"] for p in pairs]),
           "gain_perfect_median": median([p["gain_perfect"] for p in pairs]),
           "tokens_identical": all(p["tokens_identical"] for p in pairs)}
    if out["gain_perfect_median"]:
        out["gain_over_perfect"] = out["gain_median"] / out["gain_perfect_median"]
    pg = median([p.get("predicted_gain") for p in pairs])
    if pg is not None:
        out["predicted_gain_median"] = pg
        out["predicted_minus_measured_gain"] = pg - out["gain_median"]
        out["predicted_critical_path_gain"] = median(
            [p.get("predicted_critical_path_gain") for p in pairs])
        out["critical_path_gain_median"] = median([p["critical_path_gain"] for p in pairs])
        out["predicted_minus_measured_critical_path_gain"] = median(
            [p["predicted_critical_path_gain"] - p["critical_path_gain"] for p in pairs
             if p.get("predicted_critical_path_gain") is not None])
    if "tokens" in modes:
        out["tokens_planning_critical_path_ratio"] = median(
            [p["critical_path_ratio_tokens_off"] for p in pairs])
    out["cost_planning_critical_path_ratio"] = median(
        [1.0 / (1.0 + p["critical_path_gain"]) for p in pairs])
    out["critical_gain_over_perfect_median"] = median(
        [p.get("critical_gain_over_perfect") for p in pairs])
    out["critical_path_shorter_every_pair"] = all(p["critical_path_gain"] >= 0 for p in pairs)
    if "nomove" in modes:     # the spread of an unchanged placement: the run's noise
        nm = [p["gain_nomove"] for p in pairs]
        out["nomove_wall_clock_spread"] = [min(nm), max(nm)]
    return out


def project(fit: dict, args) -> dict:
    """EP16 / EP32 on the DeepSeek decode dump with this run's fitted cost (simulator)."""
    from xllm_eplb.sim.projection import project_gain

    fixed = float(median(fit["fixed_s"])) if fit else 0.0
    row = float(median(fit["row_s"])) if fit else 0.0
    dump = ROOT.parent / "shared" / "data" / "sglang_ep_statistics" / "decode_in1000out1000.json"
    if not dump.exists():
        dump = ROOT / ".." / "shared" / "data" / "sglang_ep_statistics" / dump.name
    return {f"ep{ep}": project_gain(str(dump), ep, fixed, row, steps=args.project_steps,
                                    tokens_per_rank=args.project_tokens)
            for ep in (16, 32)} | {"fixed_s": fixed, "row_s": row, "dump": dump.name}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round, fewer requests")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--pairs", type=int, default=None, help="rounds (default 4; quick 1)")
    ap.add_argument("--tokens", action="store_true", help="also the token-planning mode")
    ap.add_argument("--project", action="store_true", help="EP16/EP32 projection (simulator)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-width", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--routing-skew", type=float, default=3.0)
    ap.add_argument("--prompt-skew", type=float, default=1.5)
    ap.add_argument("--topics", type=int, default=8,
                    help="prompt topics (the checkpoint has min(16, experts // top-k))")
    ap.add_argument("--batch", type=int, default=32, help="--max_batch_size per rank")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=None, help="per round (default 128)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--affinity", default="0,1", help="--worker_cpu_affinity of the servers")
    ap.add_argument("--warm-seconds", type=float, default=120.0)
    ap.add_argument("--project-steps", type=int, default=300)
    ap.add_argument("--project-tokens", type=int, default=16,
                    help="projection: decode tokens per rank per step")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    args.pairs = args.pairs or (1 if args.quick else 4)
    n_req = args.requests or (64 if args.quick else 128)
    modes = ["off", "on", "nomove"] + (["tokens"] if args.tokens else [])
    load0 = os.getloadavg()
    warm_p = make_prompts(n_req, args.prompt_len, args.topics, args.prompt_skew, seed=1)
    meas_p = make_prompts(n_req, args.prompt_len, args.topics, args.prompt_skew, seed=2)
    servers: dict = {}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        ckpt = make_ckpt(args, Path(tmp) / "ckpt")
        try:
            for m in modes:
                print(f"bench_e2e: starting {m}", file=sys.stderr, flush=True)
                servers[m] = Server.start(ckpt, Path(tmp) / m, _mode_flags(args, m), ep=2)
            warmed = {m: warm(servers[m], m, warm_p, args) for m in modes}
            for i in range(args.pairs):
                order = modes if i % 2 == 0 else modes[::-1]
                print(f"bench_e2e: round {i + 1}/{args.pairs} {order}", file=sys.stderr,
                      flush=True)
                rounds.append({m: measure(servers[m], meas_p, args) for m in order})
            checks = {m: cost_checks(servers[m]) for m in modes if m != "off"}
        finally:
            for s in servers.values():
                s.stop()
    summary = summarize(rounds, modes)
    fit = rounds[-1]["on"].get("cost_model") if rounds else None
    summary.update(
        load_average_start=load0, load_average_end=os.getloadavg(),
        warm={m: {k: warmed[m].get(k) for k in ("layers_committed", "rounds", "layers_regressed",
                                                 "layers_rolled_back", "slots_moved")}
              for m in modes},
        cost_model_fit=fit, commit_checks=checks, args=vars(args) | {"json": str(args.json)},
        rounds=[{m: {k: v for k, v in r[m].items() if k not in ("outputs", "cost_model")}
                 for m in r} for r in rounds])
    if args.project:
        summary["projection"] = project(fit, args)
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    print(summary_table(summary, modes))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    return 0 if summary["tokens_identical"] else 1


def _f(x, fmt: str = "{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def summary_table(s: dict, modes: list[str]) -> str:
    """The readable result: per-mode medians, per-round gains, the key numbers (all of them,
    per round, with ``--json``)."""
    pct = "{:+.1%}"
    lines = ["mode      critical ms/step  mean rank ms/step  imbalance  tokens/s  TPOT s"]
    for m in modes:
        r = s["per_mode_median"][m]
        lines.append(f"{m:<9} {_f(r['critical_ms_per_step'], '{:.2f}'):>16} "
                     f"{_f(r['mean_rank_ms_per_step'], '{:.2f}'):>18} {_f(r['imbalance']):>10} "
                     f"{_f(r['tokens_per_s'], '{:.1f}'):>9} {_f(r['tpot_s']):>7}")
    lines += ["", "round  wall-clock gain on/off  critical-path gain on/off  perfect balance"]
    for i, p in enumerate(s["pairs"], 1):
        lines.append(f"{i:<6} {_f(p['gain'], pct):>23} {_f(p['critical_path_gain'], pct):>26} "
                     f"{_f(p['critical_gain_perfect'], pct):>16}")
    keys = [("static imbalance (off)", _f(s["static_imbalance"])),
            ("critical path shorter with EPLB in every round",
             str(s["critical_path_shorter_every_pair"])),
            ("share of perfect balance reached (critical path)",
             _f(s["critical_gain_over_perfect_median"], "{:.2f}")),
            ("wall-clock gain (median)", _f(s["gain_median"], pct)),
            ("cost model: predicted / measured critical-path gain",
             f"{_f(s.get('predicted_critical_path_gain'), pct)} / "
             f"{_f(s.get('critical_path_gain_median'), pct)}"),
            ("generated tokens identical in every mode", str(s["tokens_identical"])),
            ("load average start -> end", f"{s['load_average_start'][0]:.1f} -> "
                                         f"{s['load_average_end'][0]:.1f}"),
            ("run time (s)", str(s["seconds"]))]
    if "nomove_wall_clock_spread" in s:
        lo, hi = s["nomove_wall_clock_spread"]
        keys.insert(4, ("same-placement wall-clock spread (nomove vs off: the noise)",
                        f"{lo:+.1%} .. {hi:+.1%}"))
    if "projection" in s:
        keys += [(f"projection {k}", json.dumps(v, default=str)) for k, v in
                 s["projection"].items() if k.startswith("ep")]
    lines += [""] + [f"{k}: {v}" for k, v in keys]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
