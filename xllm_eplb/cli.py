"""The ``xllm-eplb`` command line: a click group; each subcommand lives in ``commands/``.

No logic here: subcommands are imported lazily so ``xllm-eplb --help`` stays fast and one broken
subsystem cannot take the others down.
"""

from __future__ import annotations

import importlib

import click

from xllm_eplb import __version__

# name -> (module under xllm_eplb.commands, attribute, one-line help)
SUBCOMMANDS = {
    "serve": ("serve", "serve", "Run the engine and one worker per EP rank."),
    "plan": ("plan", "plan", "Compute a placement from an expert-load file."),
    "simulate": ("simulate", "simulate", "Replay a load trace through the EPLB control plane."),
    "config": ("config", "config", "Show or validate the resolved configuration."),
    "shm": ("shm", "shm", "List or clean this project's shared-memory objects."),
    "bench": ("bench", "bench", "Drive a running server and report throughput and latency."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        mod, attr, _ = SUBCOMMANDS[name]
        return getattr(importlib.import_module(f"xllm_eplb.commands.{mod}"), attr)

    def format_commands(self, ctx, formatter):
        rows = [(n, SUBCOMMANDS[n][2]) for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="xllm-eplb")
def cli() -> None:
    """xllm-eplb: MoE inference with live Expert Parallel Load Balancing."""


def main() -> None:
    cli()
