"""What EPLB would gain at a larger EP size, on a recorded expert distribution, under a cost
model (fixed seconds per active slot + seconds per row) fitted on a real run.

:func:`project_gain` samples ``steps`` decode steps of ``tokens_per_rank x ep`` tokens from an
SGLang dump (``sim.generators``), replays them through the real manager (sync runner) with
:class:`~xllm_eplb.sim.replay.ReplayOptions` ``cost``: the simulated workers report the
modelled expert seconds, so the manager fits the same model and plans on it. It reports the
modelled MoE critical path per step (sum over layers of the slowest rank) under the static
placement and under EPLB (mean over the steps after the first activation), the perfect-balance
bound (the static mean rank), and the same replay planned on token counts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from xllm_eplb.config import EplbConfig
from xllm_eplb.sim.generators import generate
from xllm_eplb.sim.replay import ReplayOptions, replay


def _critical(res) -> dict:
    crit = res.extra["critical"]
    start = res.first_activation or 0
    eplb, static, mean = crit[start:].mean(axis=0)
    return {"critical_static_s": float(static), "critical_eplb_s": float(eplb),
            "critical_perfect_s": float(mean), "gain": float(static / eplb - 1.0),
            "gain_perfect": float(static / mean - 1.0),
            "layers_committed": int(res.stats["layers_committed"]),
            "slots_moved": int(res.stats["slots_moved"])}


def project_gain(dump: str, ep: int, fixed: float, row: float, *, steps: int = 300,
                 tokens_per_rank: int = 16, redundant: int = 1,
                 interval_steps: int = 50) -> dict:
    """See the module doc. ``dump``: the dump's path; ``interval_steps``: steps between
    rebalance rounds. Returns the cost-planned and the token-planned numbers."""
    p = Path(dump)
    trace = generate(f"sglang:{p.stem},steps={steps},tokens={tokens_per_rank * ep},"
                     f"dir={p.parent}")
    opts = ReplayOptions(step_seconds=1.0, cost=(float(fixed), float(row)))
    base = EplbConfig(ep_size=ep, redundant_experts_num=redundant,
                      eplb_update_interval=float(interval_steps), eplb_policy_kind="incremental",
                      eplb_heartbeat_seconds=1e9)
    out = {"ep_size": ep, "steps": steps, "tokens_per_rank": tokens_per_rank,
           "layers": trace.layers, "experts": trace.experts}
    for plan_on in ("cost", "tokens"):
        cfg = dataclasses.replace(base, eplb_plan_on=plan_on)
        out[plan_on] = _critical(replay(trace, cfg, opts))
    out["static_imbalance"] = out["cost"]["critical_static_s"] / out["cost"][
        "critical_perfect_s"]
    out["cost_gain_over_perfect"] = (out["cost"]["gain"] / out["cost"]["gain_perfect"]
                                     if out["cost"]["gain_perfect"] > 0 else float("nan"))
    return out

