"""``xllm-eplb simulate``: replay a load trace through the EPLB control plane, offline.

Same code as the engine (aggregator, estimator, manager, policy; sync runner with a simulated
clock advancing ``--step-seconds`` per step) with simulated workers that acknowledge a prepare
after ``--transfer-steps-per-layer`` forwards. Writes ``summary.json`` and plots to ``--out``
and prints a text summary. See ``xllm_eplb/sim/generators.py`` for the ``--generate`` language.

Examples::

    xllm-eplb simulate --generate 'zipf:layers=8,experts=64,steps=2000,drift=0.01' \\
        --ep-size 8 --redundant-experts-num 1 --policy balanced --out out/sim
    xllm-eplb simulate --generate 'sglang:decode_in1000out1000->decode_in500out1500,steps=2000' \\
        --ep-size 32 --redundant-experts-num 1 --policy incremental --eplb_update_interval=5 \\
        --out out/sim_real
    xllm-eplb simulate --generate 'sglang:decode_in1000out1000,steps=500' --tokens-per-rank 16 \\
        --ep-size 32 --redundant-experts-num 1 --policy incremental \\
        --eplb_replica_routing=balanced --out out/sim_routing

Replica routing: without ``--eplb_replica_routing`` (flag or config file) the replay splits each
expert's step total evenly over its replicas; with it, each step's counts are split over source
ranks (the trace's ``sources``, else a seeded multinomial split) and routed by that mode
(``sim/replay.py``). ``summary.json`` always has ``step_peak_over_ideal``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import click

from xllm_eplb.cli import _EPILOG, CONFIG_CONTEXT_SETTINGS, handle_user_errors
from xllm_eplb.config import Config, normalize_policy_kind, validate
from xllm_eplb.errors import ConfigError, InputFileError

log = logging.getLogger(__name__)


#: where ``--generate 'sglang:NAME...'`` looks up NAME.json (relative to the working directory)
DEFAULT_DATA_DIR = "../shared/data/sglang_ep_statistics"


def _load(trace: str | None, spec: str | None, steps: int | None, data_dir: str | None = None):
    from xllm_eplb.sim.generators import generate
    from xllm_eplb.sim.trace import load_trace

    if bool(trace) == bool(spec):
        raise ConfigError("simulate: give exactly one of --trace FILE or --generate SPEC")
    tr = load_trace(trace) if trace else generate(spec, data_dir=data_dir)
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"--steps={steps}: must be >= 1")
        if steps > tr.steps:
            raise InputFileError(f"--steps={steps}: the trace has only {tr.steps} steps")
        tr = tr.head(steps)
    return tr


def _spec_keys(spec: str) -> dict:
    from xllm_eplb.sim.generators import parse_spec
    return parse_spec(spec)[2]


def _per_rank_spec(spec: str | None, tokens_per_rank: int | None, ep_size: int) -> str | None:
    """The ``--generate`` spec with ``tokens = ep_size x --tokens-per-rank`` (None: unchanged)."""
    if tokens_per_rank is None:
        return spec
    if tokens_per_rank < 1:
        raise ConfigError(f"--tokens-per-rank={tokens_per_rank}: must be >= 1")
    if not spec:
        raise ConfigError("--tokens-per-rank: sets the per-step sample size of a generated "
                          "trace, so it needs --generate (a --trace fixes its own counts)")
    if "tokens" in _spec_keys(spec):
        raise ConfigError(f"--tokens-per-rank={tokens_per_rank} and --generate {spec!r} "
                          f"(tokens=) both set the per-step sample size: give one")
    return f"{spec},tokens={tokens_per_rank * ep_size}"


def _resolve_config(argv: list[str], tr, policy: str | None) -> tuple[Config, bool]:
    """Every config flag, with the expert count taken from the trace; also whether
    ``eplb_replica_routing`` was set (flag or config file) rather than left at its default.

    The trace fixes ``num_experts``: it is resolved (and the cross-field rules checked) with the
    trace's value; a ``--num_experts`` (flag or config file) that differs is an error.
    """
    from xllm_eplb.flags import load_config

    try:
        cfg, _ = load_config([*argv, f"--num_experts={tr.experts}"])
    except ConfigError as e:
        if "num_experts" not in str(e):
            raise
        raise ConfigError(f"trace has {tr.experts} experts per layer: {e}") from None
    try:
        user, sources = load_config(argv, require_ep_size=False)
    except ConfigError:      # e.g. the default num_experts does not fit; the trace's value did
        user, sources = None, {}
    if user is not None and sources["num_experts"] != "default" \
            and user.model.num_experts != tr.experts:
        raise InputFileError(f"trace has {tr.experts} experts per layer but --num_experts="
                             f"{user.model.num_experts}: they must match (or drop --num_experts)")
    if policy:
        e = dataclasses.replace(cfg.eplb, eplb_policy_kind=normalize_policy_kind(policy))
        cfg = validate(dataclasses.replace(cfg, eplb=e))
    return cfg, sources.get("eplb_replica_routing", "default") != "default"


def _dump(summary: dict) -> str:
    """Pretty top level, one line per step record (keeps 2000-step files small)."""
    head = {k: v for k, v in summary.items() if k != "steps"}
    body = json.dumps(head, indent=1)[:-2]
    steps = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in summary["steps"])
    return f'{body},\n "steps": [\n  {steps}\n ]\n}}\n'


def _text_summary(s: dict, out: Path) -> str:
    first = s["first_activation_step"]
    return "\n".join([
        f"policy={s['policy']} steps={len(s['steps'])} rounds={s['rounds']} "
        f"layers_committed={s['layers_committed']} timeouts={s['timeouts']} "
        f"first_activation_step={first}",
        f"balancedness ({s['window_steps']}-step windows, from each layer's first activation): "
        f"static={s['balancedness_static']:.4f} eplb={s['balancedness_eplb']:.4f}",
        f"balancedness (windows from the first activation of any layer): "
        f"static={s['balancedness_static_global_start']:.4f} "
        f"eplb={s['balancedness_eplb_global_start']:.4f}",
        f"step peak/ideal (mean from the first activation, routing "
        f"{s['replica_routing']}): static={s['step_peak_over_ideal_static']:.4f} "
        f"eplb={s['step_peak_over_ideal']:.4f}",
        f"modelled MoE step cost (sum over layers of the max rank load, mean per step): "
        f"static={s['step_cost_static_mean']:.0f} eplb={s['step_cost_eplb_mean']:.0f}",
        f"slots_moved={s['slots_moved']} weight_copies={s['weight_copies']} "
        f"replay_seconds={s['wall_seconds']}",
        f"wrote {out / 'summary.json'}",
    ] + ([why] if (why := _no_round_note(s)) else []))


def _no_round_note(s: dict) -> str | None:
    """Why no round ran (or none committed), in one line; None when a layer was committed."""
    steps, dt = len(s["steps"]), float(s.get("step_seconds") or 0.0)
    first, interval = int(s.get("eplb_first_round_samples", 0)), float(s["eplb_update_interval"])
    if s["rounds"] == 0:
        need = [f"--eplb_update_interval={interval:g} s of simulated time (the trace is "
                f"{steps} steps x --step-seconds={dt:g} = {steps * dt:g} s)"]
        if first:
            need.insert(0, f"--eplb_first_round_samples={first} samples")
        return (f"note: no EPLB round ran: the first round needs {' or '.join(need)}; "
                f"lower one of them (e.g. --eplb_update_interval=5) or replay more steps")
    if s["layers_committed"] == 0:
        return (f"note: {s['rounds']} rounds ran but none published a layer: no candidate "
                f"lowered the peak rank load by --eplb_min_peak_load_improvement="
                f"{s.get('eplb_min_peak_load_improvement')}")
    return None


@click.command("simulate", context_settings=CONFIG_CONTEXT_SETTINGS, epilog=_EPILOG)
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help="load trace .npz with int64 loads [steps, layers, experts]")
@click.option("--generate", "spec", default=None,
              help="synthetic trace, e.g. 'zipf:layers=8,experts=64,steps=2000,drift=0.01' or "
                   "'sglang:decode_in1000out1000->decode_in500out1500,steps=2000,tokens=4096'")
@click.option("--data-dir", default=DEFAULT_DATA_DIR, show_default=True,
              type=click.Path(file_okay=False),
              help="folder of the static load dumps an 'sglang:' spec names (its dir= wins)")
@click.option("--policy", default=None,
              help="placement policy (same as --eplb_policy_kind)")
@click.option("--steps", type=int, default=None, help="replay only the first K steps")
@click.option("--tokens-per-rank", type=int, default=None,
              help="generated traces: tokens per EP rank per step (the spec's tokens = this x "
                   "ep_size)")
@click.option("--step-seconds", type=float, default=0.05, show_default=True,
              help="simulated seconds per forward step")
@click.option("--transfer-steps-per-layer", type=int, default=1, show_default=True,
              help="forwards until every rank has prepared a layer (1 = the same forward)")
@click.option("--window-steps", type=int, default=100, show_default=True,
              help="steps per balancedness window")
@click.option("--save-trace", type=click.Path(dir_okay=False), default=None,
              help="also write the (generated) trace as .npz")
@click.option("--plots/--no-plots", default=True, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="output directory (summary.json, plots, simulate.log)")
@handle_user_errors
def simulate(trace_path, spec, data_dir, policy, steps, tokens_per_rank, step_seconds,
             transfer_steps_per_layer, window_steps, save_trace, plots, out_dir):
    """Replay a load trace through aggregator + estimator + manager + policy.

    Needs --ep-size (a config flag) and --trace or --generate; every config flag and --config
    are accepted.
    """
    from xllm_eplb.obs.logs import setup_logging
    from xllm_eplb.sim.replay import ReplayOptions, replay, summarize
    from xllm_eplb.sim.trace import save_trace as write_trace

    if step_seconds <= 0:
        raise ConfigError(f"--step-seconds={step_seconds}: must be > 0")
    if transfer_steps_per_layer < 1:
        raise ConfigError(f"--transfer-steps-per-layer={transfer_steps_per_layer}: must be >= 1")
    if window_steps < 1:
        raise ConfigError(f"--window-steps={window_steps}: must be >= 1")
    argv = list(click.get_current_context().args)
    if tokens_per_rank is not None:
        _per_rank_spec(spec, tokens_per_rank, 1)                  # bad input first
        probe = _load(None, f"{spec},steps=1", None, data_dir)    # its expert count only
        spec = _per_rank_spec(spec, tokens_per_rank, int(_resolve_config(
            argv, probe, policy)[0].eplb.ep_size))
    tr = _load(trace_path, spec, steps, data_dir)
    cfg, routed = _resolve_config(argv, tr, policy)
    if save_trace:
        try:
            write_trace(tr, save_trace)
        except OSError as e:
            raise ConfigError(f"--save-trace={save_trace}: cannot write ({e})") from None
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out={out_dir}: cannot create the output folder ({e})") from None
    (out / "simulate.log").unlink(missing_ok=True)        # one run per log, never appended
    setup_logging("simulate", cfg.serve.v, log_file=str(out / "simulate.log"), stream=None)
    opts = ReplayOptions(step_seconds, transfer_steps_per_layer, window_steps,
                         routing=cfg.eplb.eplb_replica_routing if routed else None)
    run = {"trace": trace_path or spec, "ep_size": cfg.eplb.ep_size,
           "redundant_experts_num": cfg.eplb.redundant_experts_num,
           "layers": tr.layers, "experts": tr.experts,
           "step_seconds": step_seconds, "tokens_per_rank": tokens_per_rank,
           "transfer_steps_per_layer": transfer_steps_per_layer,
           "estimator": cfg.eplb.eplb_use_estimator,
           "eplb_update_interval": cfg.eplb.eplb_update_interval,
           "eplb_first_round_samples": cfg.eplb.eplb_first_round_samples,
           "eplb_min_peak_load_improvement": cfg.eplb.eplb_min_peak_load_improvement}
    res = dataclasses.replace(replay(tr, cfg.eplb, opts), extra=run)
    summary = summarize(res)
    (out / "summary.json").write_text(_dump(summary))
    if plots:
        from xllm_eplb.sim.plots import write_plots
        write_plots(res, tr, out)
    click.echo(_text_summary(summary, out))
