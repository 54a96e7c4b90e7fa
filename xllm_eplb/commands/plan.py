"""``xllm-eplb plan``: compute a placement offline from an expert-load file.

Example::

    xllm-eplb plan --load ../shared/data/sglang_ep_statistics/decode_in1000out1000.json \\
        --ep-size 32 --redundant-experts-num 1 --policy incremental \\
        --output placement.json --report report.md --plot rank_load.png

``--format sglang|vllm-ascend|trtllm`` writes the file that engine reads instead (see
docs/integrations.md), read back by that engine's rules before the command succeeds.

Output JSON (native): ``ep_size``, ``slots_per_rank``, ``num_logical_experts``, ``policy``, ``moe_layers``
(``[first, stop)`` MoE-local, after skipping dense layers), ``dense_layers_skipped``, ``phy2log``
(``[layers][ep_size*slots]``), ``policy_seconds`` (time spent in the policy alone) and, with
``--previous``, ``moved_slots`` and ``weight_copies``. Files are written via temp + rename.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click
import numpy as np

from xllm_eplb.cli import handle_user_errors
from xllm_eplb.eplb.balance import balancedness, rank_loads_from_phy2log
from xllm_eplb.eplb.loads import parse_layer_range
from xllm_eplb.eplb.placement import diff, validate_table
from xllm_eplb.errors import InputFileError, UserError
from xllm_eplb.obs.files import write_atomic


def check_outputs(output: str, report: str | None, plot: str | None) -> None:
    """Fail before any work if an output path cannot be written: its folder is missing or it is
    a directory, or the plot's suffix is not an image format matplotlib can write."""
    for flag, path in (("--output", output), ("--report", report), ("--plot", plot)):
        if not path:
            continue
        p = Path(path)
        parent = p.parent if str(p.parent) else Path(".")
        if p.is_dir():
            raise UserError(f"{flag}={path}: is a directory (expected a file path)")
        if not parent.is_dir():
            raise UserError(f"{flag}={path}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise UserError(f"{flag}={path}: folder {parent} is not writable")
    if plot and Path(plot).suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if Path(plot).suffix[1:].lower() not in kinds:
            raise UserError(f"--plot={plot}: unsupported image format "
                            f"(use one of {', '.join(sorted(kinds))})")


def read_previous(path: str, layers: range, total_layers: int, ep_size: int, slots: int,
                  num_logical: int) -> np.ndarray:
    """A previous placement: a plan output (``{"phy2log": ...}``) or a bare list of lists with
    either one row per planned layer or one per MoE layer of the load file. -> int64 [L, D*S]."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputFileError(f"{p}: previous placement not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputFileError(f"{p}: cannot read previous placement ({e})") from None
    if isinstance(data, dict):
        if "phy2log" not in data:
            raise InputFileError(f"{p}: no 'phy2log' key in the previous placement")
        if "ep_size" in data and int(data["ep_size"]) != ep_size:
            raise InputFileError(f"{p}: previous placement has ep_size={data['ep_size']}, "
                                 f"this plan uses --ep-size={ep_size}")
        data = data["phy2log"]
    try:
        a = np.asarray(data, dtype=np.int64)
    except (TypeError, ValueError):
        raise InputFileError(f"{p}: phy2log must be a [layers][slots] table of integers") from None
    want = (len(layers), ep_size * slots)
    if a.ndim == 2 and a.shape == (total_layers, want[1]) and total_layers != want[0]:
        a = a[layers.start:layers.stop]
    if a.shape != want:
        raise InputFileError(f"{p}: previous phy2log has shape {a.shape}, expected {want} "
                             f"(layers x ep_size*slots_per_rank)")
    validate_table(a, num_logical, ep_size, f"{p}: layer {{}}", InputFileError, per_rank_cap=slots,
                   first_layer=layers.start)
    return a


def make_layout_policy(kind, ep_size, num_e, redundant, slots, opts):
    """The policy for ``slots`` per rank (the engine's rules when E divides, else explicit
    slots), with the option check of ``make_policy``."""
    from xllm_eplb.eplb.policy import make_policy, policy_class

    if num_e % ep_size == 0:
        return make_policy(kind, ep_size, num_e, redundant, **opts)
    return policy_class(kind)(ep_size, num_e, redundant, slots, **opts)


def _policy_opts(kind: str, num_nodes: int, num_groups: int, budget_slots: int) -> dict:
    if kind == "node_aware":
        return dict(num_nodes=num_nodes, num_groups=num_groups)
    if kind == "incremental":
        return dict(budget_slots=budget_slots)
    return {}


def run_plan(load: str, ep_size: int, redundant: int, policy: str, previous: str | None,
             moe_layers: str | None, num_nodes: int = 1, num_groups: int = 0,
             budget_slots: int = 0, fmt: str = "native"):
    """Everything but the file writes. Returns (result dict, before [L, D], after [L, D], info).

    For another engine's file (``fmt`` not native) the expert count need not divide the EP size:
    a rank then has ``ceil(E / ep_size) + redundant`` slots (the layouts other engines plan)."""
    from xllm_eplb.eplb.placement import initial_phy2log_any
    from xllm_eplb.eplb.policy import normalize_kind
    from xllm_eplb.integrations.recordings import read_any

    lf = read_any(load, zero_ok=True)
    total, num_e = lf.loads.shape
    layers = parse_layer_range(moe_layers, total)
    loads = lf.loads[layers.start:layers.stop]
    if ep_size < 2:
        raise UserError(f"--ep-size={ep_size}: must be > 1")
    if budget_slots < 0:
        raise UserError(f"--budget-slots={budget_slots}: must be >= 0 (0 = auto)")
    if budget_slots and fmt != "native":
        raise UserError(f"--budget-slots={budget_slots}: applies to --format native only (another "
                        f"engine's file is a static plan: nothing of ours is deployed there)")
    if num_nodes < 1 or num_groups < 0:
        raise UserError(f"--num-nodes={num_nodes} --num-groups={num_groups}: need "
                        f"num_nodes >= 1 and num_groups >= 0")
    if redundant < 0:
        raise UserError(f"--redundant-experts-num={redundant}: must be >= 0")
    if num_e % ep_size and fmt == "native":
        raise InputFileError(f"{load}: {num_e} experts per layer is not divisible by "
                             f"--ep-size={ep_size} (this engine's layout rule; --format "
                             f"sglang|vllm-ascend|trtllm plan any expert count)")
    slots = -(-num_e // ep_size) + redundant
    if slots > num_e and fmt in ("native", "vllm-ascend"):
        raise UserError(f"--redundant-experts-num={redundant}: {slots} slots per rank exceed "
                        f"the {num_e} experts (one replica of an expert per rank)")
    kind = normalize_kind(policy)
    initial = np.tile(initial_phy2log_any(num_e, ep_size, slots), (len(layers), 1))
    prev = read_previous(previous, layers, total, ep_size, slots, num_e) if previous else None
    t0 = time.perf_counter()
    if fmt == "native":
        # this engine starts from xLLM's initial layout: without --previous that is deployed
        dep = initial if prev is None else prev
        pol = make_layout_policy(kind, ep_size, num_e, redundant, slots,
                                 _policy_opts(kind, num_nodes, num_groups, budget_slots))
        cands = pol.plan(loads, dep)
        table = np.stack([dep[i] if c is None else np.asarray(c, np.int64)
                          for i, c in enumerate(cands)])
    else:
        # another engine: nothing of ours is deployed there, so without --previous every layer
        # is planned fresh; the adapters' planner (an expert may repeat on a rank where that
        # engine routes over such replicas: SGLang, TensorRT-LLM)
        from xllm_eplb.integrations.core import plan_physical

        dep = initial if prev is None else prev
        table = plan_physical(loads, ep_size * slots, ep_size, kind=kind, old=prev,
                              num_nodes=num_nodes, num_groups=num_groups or None,
                              rank_repeats=fmt != "vllm-ascend")
        cands = list(table)
    seconds = time.perf_counter() - t0
    result = {
        "ep_size": ep_size, "slots_per_rank": slots, "num_logical_experts": num_e,
        "policy": kind, "moe_layers": [layers.start, layers.stop],
        "dense_layers_skipped": lf.dense_skipped,
        "phy2log": table.tolist(), "policy_seconds": round(seconds, 6),
    }
    if previous:
        d = diff(prev, table, ep_size)
        result["moved_slots"], result["weight_copies"] = d.moved_slots, d.weight_copies
    before = rank_loads_from_phy2log(dep, loads, ep_size)
    after = rank_loads_from_phy2log(table, loads, ep_size)
    skipped = [i for i, c in enumerate(cands) if c is None]
    return result, before, after, dict(skipped=skipped, layers=layers, moe_total=total)


def global_balance(rank_loads: np.ndarray) -> float:
    """Sum of the mean rank loads over the sum of the largest ones (1.0 when all zero)."""
    top = rank_loads.max(axis=1).sum()
    return 1.0 if top <= 0 else float(rank_loads.mean(axis=1).sum() / top)


def render_report(result: dict, before: np.ndarray, after: np.ndarray, load: str,
                  layers: range) -> str:
    """Markdown: per-layer balancedness (mean/max rank load) and peak/ideal, before and after."""
    bb, ba = balancedness(before), balancedness(after)
    gb, ga = global_balance(before), global_balance(after)
    lines = [
        f"# Placement plan: {result['policy']}", "",
        f"- load file: `{load}` (dense layers skipped: {result['dense_layers_skipped']})",
        f"- ep_size {result['ep_size']}, slots/rank {result['slots_per_rank']}, "
        f"experts {result['num_logical_experts']}, MoE layers {layers.start}:{layers.stop}",
        f"- policy time: {result['policy_seconds'] * 1000:.1f} ms",
        f"- global balancedness (sum mean / sum max): before {gb:.4f}, after {ga:.4f}; "
        f"peak/ideal before {1 / gb:.4f}, after {1 / ga:.4f}",
    ]
    if "moved_slots" in result:
        lines.append(f"- moved slots {result['moved_slots']}, cross-rank weight copies "
                     f"{result['weight_copies']}")
    lines += ["", "| layer | balancedness before | after | peak/ideal before | after |",
              "|---:|---:|---:|---:|---:|"]
    for i in range(before.shape[0]):
        lines.append(f"| {layers.start + i} | {bb[i]:.4f} | {ba[i]:.4f} | {1 / bb[i]:.4f} | "
                     f"{1 / ba[i]:.4f} |")
    return "\n".join(lines) + "\n"


@click.command("plan")
@click.option("--load", "load", required=True, help="expert-load file: SGLang dump .json, "
              "JSON [layers][experts], .npy, or a TensorRT-LLM expert-statistic folder")
@click.option("--ep-size", type=int, required=True, help="EP ranks")
@click.option("--redundant-experts-num", "redundant", type=int, default=1, show_default=True,
              help="extra slots per rank")
@click.option("--policy", default="incremental", show_default=True,
              help="incremental (serve's and simulate's default), balanced, greedy, node_aware "
                   "(legacy names -> balanced)")
@click.option("--previous", default=None, help="current placement JSON (a plan output); "
              "default: xLLM's initial layout")
@click.option("--moe-layers", default=None, help="a:b, MoE layers to plan (after dense ones)")
@click.option("--output", "-o", required=True, help="placement file to write (--format)")
@click.option("--format", "fmt", type=click.Choice(["native", "sglang", "vllm-ascend", "trtllm"]),
              default="native", show_default=True,
              help="native: this engine's plan JSON (serve --eplb_init_placement); sglang: "
                   "--init-expert-location JSON; vllm-ascend: expert_map_path JSON; trtllm: "
                   "MoE load balancer YAML (docs/integrations.md)")
@click.option("--report", default=None, help="markdown report to write")
@click.option("--plot", default=None, help="rank-load PNG to write")
@click.option("--num-nodes", type=int, default=1, show_default=True, help="node_aware: nodes")
@click.option("--num-groups", type=int, default=0, show_default=True,
              help="node_aware: expert groups (0 = one per expert)")
@click.option("--budget-slots", type=int, default=0, show_default=True,
              help="incremental: max moved slots over all layers (0 = auto)")
@handle_user_errors
def plan(load, ep_size, redundant, policy, previous, moe_layers, output, fmt, report, plot,
         num_nodes, num_groups, budget_slots):
    """Compute a placement from an expert-load file."""
    check_outputs(output, report, plot)
    result, before, after, info = run_plan(load, ep_size, redundant, policy, previous,
                                           moe_layers, num_nodes, num_groups, budget_slots,
                                           fmt)
    if not before.any():
        click.echo(f"every layer of {load} has zero load: planned as MoE layers without load "
                   f"information (even replica counts)")
    if result["dense_layers_skipped"]:
        click.echo(f"skipped {result['dense_layers_skipped']} leading all-zero (dense) layers "
                   f"of {load}")
    if info["skipped"]:
        click.echo(f"policy could not plan layers {info['skipped']}: previous placement kept")
    written: list[str] = []
    try:       # plot and report first, the placement last; all or nothing
        if plot:
            from xllm_eplb.obs.plots import plot_rank_loads

            plot_rank_loads(before, after, plot, title=f"{result['policy']} ep{ep_size}"
                            f"+{redundant}", layer_ids=list(info["layers"]))
            written.append(plot)
        if report:
            write_atomic(report, render_report(result, before, after, load, info["layers"]))
            written.append(report)
        write_atomic(output, json.dumps(result) + "\n" if fmt == "native" else
                     render_format(fmt, result, info))
        written.append(output)
        check_format(fmt, output, result, info)
    except (OSError, ValueError) as e:
        for path in written:
            Path(path).unlink(missing_ok=True)
        raise UserError(f"cannot write the plan outputs: {e}") from None
    ga = global_balance(after)
    msg = (f"policy={result['policy']} layers={len(info['layers'])} "
           f"peak_over_ideal={1 / ga:.4f} balancedness={ga:.4f} "
           f"policy_ms={result['policy_seconds'] * 1000:.1f}")
    if "moved_slots" in result:
        msg += f" moved_slots={result['moved_slots']} weight_copies={result['weight_copies']}"
    click.echo(msg + f" format={fmt} output={output}")


def check_format(fmt: str, path: str, result: dict, info: dict) -> None:
    """Read a written file back by its engine's rules (``integrations.formats``);
    ``FormatError`` (a ValueError) when it breaks one."""
    if fmt == "native":
        return
    from xllm_eplb.integrations import formats

    e, ep, dense = result["num_logical_experts"], result["ep_size"], result[
        "dense_layers_skipped"]
    moe = info["moe_total"]
    if fmt == "sglang":
        formats.check_sglang(path, num_layers=dense + moe, num_logical=e, ep_size=ep,
                             num_physical=ep * result["slots_per_rank"], dense=dense)
    elif fmt == "vllm-ascend":
        formats.check_vllm_ascend(path, num_moe_layers=moe, ep_size=ep, num_logical=e)
    else:
        formats.check_trtllm(path, dense=dense, num_moe_layers=moe, num_logical=e, ep_size=ep)


def render_format(fmt: str, result: dict, info: dict) -> str:
    """The placement file of another engine (``xllm_eplb.integrations.formats``): the planned
    MoE layers, every other MoE layer on the trivial map (slot s -> expert s % E), dense layers
    as the target numbers them."""
    from xllm_eplb.integrations import formats

    table = np.asarray(result["phy2log"], dtype=np.int64)
    num_e, ep = result["num_logical_experts"], result["ep_size"]
    fill = np.tile(np.arange(table.shape[1]) % num_e, (info["moe_total"], 1))
    first = info["layers"].start
    if fmt == "vllm-ascend":
        return formats.render_ascend(table, ep, first=first, moe_fill=fill)
    return formats.render(fmt, table, num_logical=num_e, dense=result["dense_layers_skipped"],
                          first=first, moe_fill=fill)
