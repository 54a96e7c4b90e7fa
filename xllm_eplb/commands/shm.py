"""``xllm-eplb shm ls|clean``: list or remove this project's shared-memory objects.

``ls`` prints one line per object (``/dev/shm`` names starting with ``xllm_eplb_``): kind, name,
size, generation and the pids holding it. ``clean [--run-id R]`` removes the objects nobody holds
(of run R only when given) and prints what it removed; live objects are never touched.
"""

from __future__ import annotations

import click

from xllm_eplb.cli import handle_user_errors


def _run_id_option(fn):
    return click.option("--run-id", "run_id", default=None,
                        help="only objects of this run id (default: every run)")(fn)


@click.group("shm")
def shm() -> None:
    """List or clean this project's shared-memory objects (segments and semaphores)."""


@shm.command("ls")
@_run_id_option
@handle_user_errors
def ls(run_id: str | None) -> None:
    """List objects: kind, name, size, generation, live holders."""
    from xllm_eplb.ipc.objects import list_objects

    objs = list_objects(run_id)
    if not objs:
        click.echo("no xllm-eplb shared-memory objects")
        return
    click.echo(f"{'kind':<10} {'name':<44} {'size':>10} {'gen':>5}  holders")
    for o in objs:
        gen = "-" if o.generation is None else str(o.generation)
        if o.kind == "semaphore":
            holders = "-"
        else:
            holders = ",".join(map(str, o.holders)) or ("held" if o.held else "none")
        click.echo(f"{o.kind:<10} {o.name:<44} {o.size:>10} {gen:>5}  {holders}")


@shm.command("clean")
@_run_id_option
@handle_user_errors
def clean(run_id: str | None) -> None:
    """Remove objects that no live process holds; report each removal."""
    from xllm_eplb.ipc.objects import clean as do_clean
    from xllm_eplb.ipc.objects import list_objects

    removed = do_clean(run_id)
    for o in removed:
        click.echo(f"removed {o.kind} {o.name}")
    kept = list_objects(run_id)
    click.echo(f"removed {len(removed)} object(s); {len(kept)} in use left")
