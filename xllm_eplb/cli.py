"""The ``xllm-eplb`` command line: a click group; each subcommand lives in ``commands/``.

No logic here: subcommands are imported lazily so ``xllm-eplb --help`` stays fast and one broken
subsystem cannot take the others down. The decorators commands use to take configuration flags
(:func:`config_command`, :func:`with_config`) and to report user errors
(:func:`handle_user_errors`) live here too.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import traceback

import click

from xllm_eplb import __version__
from xllm_eplb.errors import UserError

# name -> (module under xllm_eplb.commands, attribute, one-line help)
SUBCOMMANDS = {
    "serve": ("serve", "serve", "Run the engine and one worker per EP rank."),
    "plan": ("plan", "plan", "Compute a placement from an expert-load file."),
    "simulate": ("simulate", "simulate", "Replay a load trace through the EPLB control plane."),
    "config": ("config", "config", "Show or validate the resolved configuration."),
    "shm": ("shm", "shm", "List or clean this project's shared-memory objects."),
    "bench": ("bench", "bench", "Drive a running server and report throughput and latency."),
    "make-checkpoint": ("make_checkpoint", "make_checkpoint",
                        "Write a tiny Hugging Face-format MoE checkpoint."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        mod, attr, _ = SUBCOMMANDS[name]
        return getattr(importlib.import_module(f"xllm_eplb.commands.{mod}"), attr)

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        """click's main, but a usage error (a bad option value, a missing option) is one line
        ``error: ...`` and exit 2, like every other user error, not click's multi-line block."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            click.echo(f"error: {e.format_message()}{where}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)    # an int only from --help / --version

    def format_commands(self, ctx, formatter):
        rows = [(n, SUBCOMMANDS[n][2]) for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="xllm-eplb")
def cli() -> None:
    """xllm-eplb: MoE inference with live Expert Parallel Load Balancing."""


# --- click adapter ----------------------------------------------------------------------------

#: click context settings that let a command receive config flags as extra args
CONFIG_CONTEXT_SETTINGS = {"ignore_unknown_options": True, "allow_extra_args": True,
                           "help_option_names": ["-h", "--help"]}
_EPILOG = ("Also accepts every configuration flag (--name=value, --noname, --config FILE, "
           "--flagfile FILE); see docs/configuration.md or `xllm-eplb config docs`.")


def _debug_requested(argv: list[str] | None = None) -> bool:
    """True for ``--v=debug`` / ``--v debug`` in argv (default sys.argv) or XLLM_EPLB_DEBUG=1."""
    args = sys.argv[1:] if argv is None else argv
    for i, a in enumerate(args):
        if a == "--v=debug" or (a == "--v" and i + 1 < len(args) and args[i + 1] == "debug"):
            return True
    return os.environ.get("XLLM_EPLB_DEBUG", "") not in ("", "0")


def _fail(err: UserError, debug: bool) -> None:
    if debug:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    click.echo(f"error: {err}", err=True)
    sys.exit(getattr(err, "exit_code", 2))


def handle_user_errors(fn):
    """Decorator for a click command function: a :class:`UserError` becomes one line
    ``error: ...`` on stderr and exit code 2 (a traceback too with ``--v=debug`` in argv or
    ``XLLM_EPLB_DEBUG=1``). Place it directly above the function (below ``@click.command``)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            _fail(e, _debug_requested())
    return wrapper


def with_config(*, require_ep_size: bool = True, pass_sources: bool = False,
                positional_model: bool = False):
    """Decorator: resolve the click context's extra args with :func:`load_config` and pass
    ``cfg=`` (and ``sources=`` when ``pass_sources``) to the command function. The command
    must use :data:`CONFIG_CONTEXT_SETTINGS`; :func:`config_command` does both at once."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            argv = list(click.get_current_context().args)
            debug = _debug_requested(argv) or _debug_requested()
            try:
                from xllm_eplb.config.aliases import with_served_alias
                from xllm_eplb.flags import load_config
                from xllm_eplb.model.hub_cache import resolve_hub_names

                cfg, sources = load_config(argv, require_ep_size=require_ep_size,
                                           positional_model=positional_model)
                # the --model string as given is a served name too (vLLM's), before the
                # hub name below becomes a cache folder
                cfg = with_served_alias(cfg)
                # --model ORG/NAME: the local Hugging Face cache (the environment names it)
                cfg = resolve_hub_names(cfg, os.environ)
                debug = debug or cfg.serve.v == "debug"
                kwargs["cfg"] = cfg
                if pass_sources:
                    kwargs["sources"] = sources
                return fn(*args, **kwargs)
            except UserError as e:
                _fail(e, debug)
        return wrapper
    return deco


def config_command(name: str | None = None, *, require_ep_size: bool = True,
                   pass_sources: bool = False, positional_model: bool = False,
                   **command_kwargs):
    """A ``click.command`` that also takes every configuration flag.

    Unknown options go to :func:`load_config` (precedence defaults < --config file < --flagfile
    < command line); the function receives ``cfg: Config`` (and ``sources: dict[str, str]`` when
    ``pass_sources=True``). A UserError raised while resolving or by the command itself prints
    one line ``error: ...`` to stderr and exits 2 (traceback only with ``--v=debug``).

    Example::

        @config_command(require_ep_size=False)
        @click.option("--trace", required=True, help="load trace (.npz)")
        @click.option("--steps", type=int, default=100)
        def simulate(trace, steps, cfg):
            ...

        # xllm-eplb simulate --trace t.npz --steps 50 --ep-size 16 --eplb_update_interval=5

    Put ``@config_command(...)`` on top and the command's own ``@click.option``s below it; do
    not name an option like a config flag. ``serve`` is just
    ``@config_command() def serve(cfg): ...``.
    """
    def deco(fn):
        settings = dict(CONFIG_CONTEXT_SETTINGS, **command_kwargs.pop("context_settings", {}))
        command_kwargs.setdefault("epilog", _EPILOG)
        wrapped = with_config(require_ep_size=require_ep_size, pass_sources=pass_sources,
                              positional_model=positional_model)(fn)
        return click.command(name, context_settings=settings, **command_kwargs)(wrapped)
    return deco


def main() -> None:
    cli()
