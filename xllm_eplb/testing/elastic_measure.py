"""The arithmetic of the elastic benchmarks (``scripts/bench_elastic.py``,
``scripts/nested_faults.py``, ``scripts/soak.py --chaos``; issue #23 acceptance), free of
processes so ``tests/test_elastic_measure.py`` checks it cheaply: the ``EPLB elastic`` log lines
read back with their stamps, each kill matched to the lines that follow it (detect, resume and
the phases of the recovery), expert coverage of a deployed table, token rates around a kill,
percentiles, the chaos soak's recovery times.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np


def stamp(line: str) -> float:
    """The epoch seconds of a log line (``2026-12-02T11:27:14.123 LEVEL tag message``; the
    formatter writes local time)."""
    return datetime.datetime.fromisoformat(line.split()[0]).timestamp()


def fields(line: str) -> dict[str, str]:
    """``key=value`` pairs of an ``event()`` line (values without spaces)."""
    return dict(w.split("=", 1) for w in line.split() if "=" in w and not w.startswith("="))


def elastic_lines(log_dir: Path) -> dict[str, list[tuple[float, dict]]]:
    """The run's recovery lines, each ``(stamp, fields)``: ``launcher`` (the launcher saw the
    exit), ``detect`` (the engine starts recovery), ``resume`` (the engine serves again),
    ``resharded`` (a survivor's re-shard with its canary), ``canary_failed``."""
    run = log_dir / "latest"
    run = run if run.exists() else log_dir
    out: dict[str, list] = {k: [] for k in ("launcher", "detect", "resume", "resharded",
                                            "canary_failed")}
    keys = (("launcher.log", "EPLB elastic detect proc=", "launcher"),
            ("engine.log", "EPLB elastic detect rank=", "detect"),
            ("engine.log", "EPLB elastic resume ", "resume"))
    for name, needle, key in keys:
        path = run / name
        for ln in path.read_text().splitlines() if path.exists() else []:
            if needle in ln:
                out[key].append((stamp(ln), fields(ln)))
    for path in sorted(run.glob("rank*.log")):
        for ln in path.read_text().splitlines():
            if "EPLB elastic resharded " in ln:
                out["resharded"].append((stamp(ln), fields(ln)))
            elif "EPLB canary:" in ln:
                out["canary_failed"].append((stamp(ln), {"line": ln}))
    return out


def first_after(events: list[tuple[float, dict]], t: float, before: float = float("inf")):
    """The first ``(stamp, fields)`` of ``events`` at or after ``t`` (minus the log's 1 ms
    resolution) and before ``before``, or None."""
    got = [e for e in events if t - 0.001 <= e[0] < before]
    return min(got, key=lambda e: e[0]) if got else None


def per_kill(lines: dict, kills: list[float]) -> list[dict]:
    """Per kill (epoch seconds, sorted): kill -> the launcher saw the exit (``launcher_s``),
    -> the engine's ``detect`` line (``detect_s``: recovery starts), -> ``resume``
    (``resume_s``), and the engine's own phase durations of that recovery (fence, re-form)."""
    rows = []
    for i, t in enumerate(kills):
        nxt = kills[i + 1] if i + 1 < len(kills) else float("inf")
        row: dict = {"kill": t}
        for key, name in (("launcher", "launcher_s"), ("detect", "detect_s"),
                          ("resume", "resume_s")):
            got = first_after(lines[key], t, nxt if key != "resume" else float("inf"))
            row[name] = round(got[0] - t, 3) if got else None
            if key == "resume" and got:
                f = got[1]
                row.update(fence_s=float(f.get("fence_s", "nan")),
                           reform_s=float(f.get("reform_s", "nan")),
                           mode=f.get("mode", ""),
                           reprefilled=int(f.get("requests_reprefilled", 0)),
                           kept=int(f.get("requests_kept", 0)))
        rows.append(row)
    return rows


def coverage_gaps(placement, num_experts: int) -> list[int]:
    """Layers of a deployed table (``[L][slots]``, -1 = empty slot) that miss an expert."""
    need = set(range(num_experts))
    return [li for li, row in enumerate(placement) if not need <= set(int(x) for x in row)]


def rate(times: np.ndarray, t0: float, t1: float) -> float:
    """Tokens per second committed in ``[t0, t1)`` (``times``: every token's arrival)."""
    return float(((times >= t0) & (times < t1)).sum()) / max(t1 - t0, 1e-9)


def after_kill(times, t_kill: float, before_s: float, target: float, window: float = 2.0,
               horizon: float = 10.0) -> dict:
    """Token rate around a kill: ``before`` (the ``before_s`` seconds before it), ``after``
    (kill + 5 s .. kill + ``horizon``), and ``reach_s``: the end of the first ``window``-long
    window after the kill (0.25 s steps) whose rate is at least ``target`` x before."""
    t = np.sort(np.asarray(times, dtype=float))
    before = rate(t, t_kill - before_s, t_kill)
    after = rate(t, t_kill + horizon / 2, t_kill + horizon)
    reach = None
    for end in np.arange(window, horizon + 1e-9, 0.25):
        if before > 0 and rate(t, t_kill + end - window, t_kill + end) >= target * before:
            reach = round(float(end), 2)
            break
    return {"before_tok_s": round(before, 2), "after_tok_s": round(after, 2),
            "after_ratio": round(after / before, 3) if before else None,
            "target_ratio": round(target, 3), "reach_s": reach}


def pct(xs, *qs) -> dict:
    """``{"p50": .., "p95": .., "max": ..}`` of the finite values (None when there are none)."""
    a = np.asarray([x for x in xs if x is not None], dtype=float)
    a = a[np.isfinite(a)]
    out = {f"p{q}": (round(float(np.percentile(a, q)), 3) if a.size else None) for q in qs}
    out["max"] = round(float(a.max()), 3) if a.size else None
    out["n"] = int(a.size)
    return out


def token_faults(got: list[int], ref: list[int]) -> str:
    """'' when a stream equals its reference, else what went wrong: ``duplicated`` (a token
    repeated: the stream is longer or a window of it recurs), ``skipped`` (shorter) or
    ``changed``."""
    if got == ref:
        return ""
    if len(got) > len(ref):
        return "duplicated"
    if len(got) < len(ref) and got == ref[:len(got)]:
        return "truncated"
    if len(got) < len(ref):
        return "skipped"
    return "changed"


def recoveries(log_dir: Path, kills: list[tuple[float, str]]) -> dict:
    """The chaos soak's recovery times (``scripts/soak.py --chaos``), from the launcher's and
    the engine's logs, per kill (``kills``: (epoch time, victim)): kill -> the launcher saw the
    exit, -> the engine's ``EPLB elastic detect`` (recovery starts), -> ``EPLB elastic
    resume``; and the engine's own ``detect_s`` (launcher notice -> engine) and re-form
    seconds."""
    lines = elastic_lines(log_dir)
    rows = per_kill(lines, sorted(t for t, _ in kills))
    return {"detect_s": [float(f["detect_s"]) for _, f in lines["detect"]],
            "recovery_s": [float(f["seconds"]) for _, f in lines["resume"]],
            "reform_s": [float(f["reform_s"]) for _, f in lines["resume"]],
            "kill_to_launcher_s": [r["launcher_s"] for r in rows],
            "kill_to_detect_s": [r["detect_s"] for r in rows],
            "kill_to_resume_s": [r["resume_s"] for r in rows]}
