"""``xllm-eplb bench``'s EPLB section and ``--compare``: what EPLB did on the server, read from
its ``/eplb/status`` before and after the run, in the numbers that carry the gain.

Per forward step, over the steps of the run (deltas of ``critical_path``):

- MoE critical path now: the sum over MoE layers of the slowest rank's expert CPU seconds (each
  rank's own ``time.thread_time``, so it does not depend on how ranks share cores);
- under perfect balance: the mean rank's (every rank's expert work equal);
- at the initial placement: the critical path now scaled by the cost model's modelled critical
  paths (initial / deployed, ``cost_model``); with EPLB off the initial placement is the one
  served; None while the model is not fitted;
- the modelled step on its own device per rank: the mean rank's other forward CPU (attention,
  dense layers, routing: ``forward_cpu_s - expert_cpu_s``) plus the MoE critical path; its
  inverse is tokens/s, so the gain of the current placement over the initial one is
  ``T(initial) / T(now) - 1`` and what perfect balance would add ``T(now) / T(perfect) - 1``.

When the node runs more processes (ranks + engine) than it has cores (``cores.shared``), the
ranks take turns: wall-clock tokens/s follows the total work, which no placement changes, so
only the modelled gain can show EPLB's; the section says so in one line.

``--compare URL2`` (:func:`compare`): the same requests against two servers, alternately
(A B, B A, ...), ``--pairs`` times; one table of per-server medians and the per-pair change
of B over A (median, min .. max).
"""

from __future__ import annotations

from statistics import median


def _delta(before: dict, after: dict, key: str) -> float:
    a, b = before.get("critical_path") or {}, after.get("critical_path") or {}
    return float(b.get(key, 0.0)) - float(a.get(key, 0.0))


def eplb_numbers(before: dict, after: dict) -> dict:
    """The section's numbers from two ``/eplb/status`` dicts (seconds per step; None where the
    server gave nothing to compute them from)."""
    steps = _delta(before, after, "steps")
    d = int(after.get("ep_size") or 1)
    served_before = float((before.get("critical_path") or {}).get("steps", 0.0)) > 0
    out: dict = {"enabled": bool(after.get("enabled")), "steps": int(steps),
                 "balancedness_initial": after.get("initial_balancedness_mean"),
                 # None before any served step (the warm-up's window is no load)
                 "balancedness_before": before.get("balancedness_mean") if served_before
                 else None,
                 "balancedness_now": after.get("balancedness_mean"),
                 "slots_moved": after.get("slots_moved", 0),
                 "slots_moved_during_run": after.get("slots_moved", 0)
                 - before.get("slots_moved", 0),
                 "layers_committed": after.get("layers_committed", 0),
                 "layers_committed_during_run": after.get("layers_committed", 0)
                 - before.get("layers_committed", 0),
                 "layers_rolled_back": after.get("layers_rolled_back", 0),
                 "layers_rolled_back_during_run": after.get("layers_rolled_back", 0)
                 - before.get("layers_rolled_back", 0),
                 "next_round": after.get("next_round") or None,
                 "balance_note": after.get("balance_note"),
                 "cores": after.get("cores") or {}}
    if steps <= 0:
        return out
    crit = _delta(before, after, "critical_s") / steps
    perfect = _delta(before, after, "expert_cpu_s") / steps / d
    other = max(0.0, (_delta(before, after, "forward_cpu_s")
                      - _delta(before, after, "expert_cpu_s")) / steps / d)
    cm = after.get("cost_model") or {}
    initial, source = None, "cost model not fitted yet"
    if not out["enabled"]:
        initial, source = crit, "EPLB off: served as is"
    elif not after.get("placement_epoch"):
        initial, source = crit, "nothing committed yet"
    elif cm.get("predicted_critical_s") and cm.get("predicted_critical_initial_s"):
        initial = crit * cm["predicted_critical_initial_s"] / cm["predicted_critical_s"]
        source = "modelled: now x cost model initial/now"
    out.update(critical_s=crit, perfect_s=perfect, initial_s=initial, initial_source=source,
               other_s=other)
    if crit > 0:
        out["gain_over_perfect_left"] = (other + crit) / (other + perfect) - 1.0
        if initial is not None:
            out["modelled_gain"] = (other + initial) / (other + crit) - 1.0
    return out


def _ms(x) -> str:
    return "n/a" if x is None else f"{x * 1e3:.3f}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _bal(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def eplb_rows(n: dict) -> list[tuple[str, str]]:
    """The EPLB section of the table (``n``: :func:`eplb_numbers`)."""
    rows = [("EPLB", "on" if n["enabled"] else "off"),
            ("Steps measured", str(n["steps"]))]
    if "critical_s" in n:
        rows += [("MoE critical path (ms/step)", _ms(n["critical_s"])),
                 ("  at the initial placement", f"{_ms(n['initial_s'])} ({n['initial_source']})"),
                 ("  under perfect balance", _ms(n["perfect_s"])),
                 ("Other fwd CPU per rank (ms/step)", _ms(n["other_s"]))]
    rows += [("Balancedness first/before/now",
              f"{_bal(n['balancedness_initial'])}, {_bal(n.get('balancedness_before'))}, "
              f"{_bal(n['balancedness_now'])}"),
             ("Slots moved (total, this run)",
              f"{n['slots_moved']}, {n['slots_moved_during_run']}"),
             ("Layers committed (total, run)",
              f"{n['layers_committed']}, {n.get('layers_committed_during_run', 0)}"),
             ("Layers rolled back (total, run)",
              f"{n['layers_rolled_back']}, {n.get('layers_rolled_back_during_run', 0)}")]
    if n.get("enabled") and n.get("next_round"):
        rows.append(("Next EPLB round", n["next_round"]))
    if "critical_s" in n:
        rows += [("Modelled tok/s gain vs initial", _pct(n.get("modelled_gain"))
                  + " (a device per rank)"),
                 ("  left to perfect balance", _pct(n.get("gain_over_perfect_left")))]
    return rows


def eplb_notes(n: dict) -> list[str]:
    """Lines under the section: shared cores, a balancedness below the initial one."""
    out = []
    c = n["cores"]
    if c.get("shared"):
        out.append(f"note: {c['processes']} processes (EP ranks + engine) share {c['cpus']} "
                   f"cores: ranks take turns, so wall-clock tok/s measures their total work, "
                   f"not the slowest rank, and cannot show EPLB's gain; the MoE critical path "
                   f"and the modelled gain above do")
    if n.get("balance_note"):
        out.append(f"note: {n['balance_note']}")
    return out


# --- --compare --------------------------------------------------------------------------------

#: (label, key of a run's numbers, format, which direction is better)
COMPARE_ROWS = (("Output tok/s", "tokens_per_s", "{:.1f}", "higher"),
                ("TPOT mean (ms)", "tpot_ms", "{:.2f}", "lower"),
                ("TTFT p50 (ms)", "ttft_ms", "{:.1f}", "lower"),
                ("MoE critical path (ms/token)", "critical_ms", "{:.4f}", "lower"),
                ("Perfect balance (ms/token)", "perfect_ms", "{:.4f}", "lower"),
                ("Critical / perfect", "imbalance", "{:.3f}", "lower"),
                ("Balancedness (after)", "balancedness", "{:.4f}", "higher"))


def run_numbers(res: dict, before: dict, after: dict) -> dict:
    """One measured run: wall clock from ``res`` (``run_bench``), the rest from the statuses.

    The MoE critical path is per output token of the run (its total over the run's steps /
    the output tokens), not per step: both servers get the same requests, but they batch them
    into different steps, so a per-step figure compares different work."""
    n = eplb_numbers(before, after)
    crit, perf = n.get("critical_s"), n.get("perfect_s")
    per_tok = n["steps"] / res["output_tokens"] if res.get("output_tokens") else None
    return {"tokens_per_s": res["tokens_per_s"], "tpot_ms": res["tpot_mean_s"] * 1e3,
            "ttft_ms": res["ttft_p50_s"] * 1e3,
            "critical_ms": None if crit is None or per_tok is None else crit * per_tok * 1e3,
            "perfect_ms": None if perf is None or per_tok is None else perf * per_tok * 1e3,
            "imbalance": crit / perf if crit and perf else None,
            "balancedness": n["balancedness_now"], "errors": res["errors"],
            "enabled": n["enabled"], "cores": n["cores"]}


def compare(run_a, run_b, pairs: int) -> list[tuple[dict, dict]]:
    """``pairs`` (A, B) rounds, the order alternated (A B, B A, ...): ``run_x()`` -> numbers."""
    out = []
    for i in range(pairs):
        if i % 2 == 0:
            a = run_a()
            b = run_b()
        else:
            b = run_b()
            a = run_a()
        out.append((a, b))
    return out


def _med(xs):
    xs = [x for x in xs if x is not None]
    return median(xs) if xs else None


def compare_table(url_a: str, url_b: str, rounds: list[tuple[dict, dict]],
                  width: int = 96) -> str:
    """Side by side: per-server medians, and B over A per pair (median, min .. max)."""
    def side(x: dict) -> str:
        return "EPLB on" if x["enabled"] else "EPLB off"

    a0, b0 = rounds[0]
    head = (f"{'':<30}{'A':>11}{'B':>11}{'B vs A (median)':>17}{'pairs min .. max':>19}"
            f"{'better':>8}")
    lines = [" xllm-eplb bench --compare ".center(width, "="),
             f"A: {url_a} ({side(a0)})", f"B: {url_b} ({side(b0)})",
             f"{len(rounds)} pairs, alternated (A B, B A, ...); the same requests each run",
             "-" * width, head]
    for label, key, fmt, better in COMPARE_ROWS:
        a = _med([r[0][key] for r in rounds])
        b = _med([r[1][key] for r in rounds])
        rel = [r[1][key] / r[0][key] - 1.0 for r in rounds
               if r[0][key] and r[1][key] is not None]
        cells = [fmt.format(v) if v is not None else "n/a" for v in (a, b)]
        spread = f"{min(rel):+.1%} .. {max(rel):+.1%}" if rel else "n/a"
        lines.append(f"{label:<30}{cells[0]:>11}{cells[1]:>11}"
                     f"{_verdict(_med(rel), better) if rel else 'n/a':>17}{spread:>19}"
                     f"{better:>8}")
    lines.append("=" * width)
    lines.append("B vs A: B's median change over A, and whether that is better or worse for "
                 "B by the row's direction ('better': higher or lower); the MoE critical path is "
                 "per output token (the same requests on both: the same work), not per step "
                 "(each server batches them into different steps)")
    if (a0["cores"] or {}).get("shared") or (b0["cores"] or {}).get("shared"):
        lines.append("note: ranks share cores on at least one server: the tok/s pairs measure "
                     "total work, not the slowest rank; the MoE critical path per token carries "
                     "EPLB's gain")
    return "\n".join(lines)


def _verdict(rel: float, better: str) -> str:
    """``-9.0% B better``: the median change of B over A and what it means for the row."""
    if abs(rel) < 5e-4:
        return f"{rel:+.1%} same"
    good = (rel > 0) == (better == "higher")
    return f"{rel:+.1%} B {'better' if good else 'worse'}"
