"""``xllm-eplb serve``: create the run's shared memory, spawn the engine and one worker per EP
rank, show start-up progress and print the ready line (both in ``obs/progress.py``), supervise,
and tear everything down.

Process tree (spawn context)::

    launcher (xllm-eplb:launcher) ── engine (xllm-eplb:engine)  HTTP, scheduler, EPLB manager
                                  └─ worker 0..N-1 (xllm-eplb:ep<r>)  model shard, executor

Stopping: SIGINT/SIGTERM -> the launcher asks the engine to stop (SIGTERM); the engine sends the
shutdown message through the input ring, workers leave their loop; whatever has not exited after
``--shutdown_timeout_seconds`` is killed. If any child dies, the launcher stops the rest and exits
1 naming the process and its exit cause. NOTE: children ignore SIGINT (a terminal ^C reaches the
whole process group; only the launcher decides) and die with the launcher (PR_SET_PDEATHSIG,
plus a parent-pid check), and the launcher always sweeps the run's ``/dev/shm`` objects last.

Modules: ``launcher`` (:class:`Launcher`: spawn, supervise, stop; ``--elastic_ep``: it hosts the
store and owns an ``elastic/supervisor.ElasticSupervisor``), ``events``
(:class:`EventHub`, the launcher's end of the child channels), ``rings`` (:class:`RunShm`),
``exits`` (naming a child's exit), ``run`` (the ``serve`` entry and :func:`run_launcher`).
"""

from __future__ import annotations

from xllm_eplb.launcher.events import EventHub
from xllm_eplb.launcher.exits import describe_exit, log_name, wall_clock
from xllm_eplb.launcher.launcher import CHILD_ENV, Launcher
from xllm_eplb.launcher.rings import RunShm
from xllm_eplb.launcher.run import (
    console_notes,
    free_port,
    launcher_process,
    resolve_runtime,
    run_launcher,
    serve,
    sweep_dead_at_start,
)
from xllm_eplb.obs.progress import Progress, ready_line
from xllm_eplb.preflight import StartupError, check_port

__all__ = ["CHILD_ENV", "EventHub", "Launcher", "Progress", "RunShm", "StartupError",
           "check_port", "console_notes", "describe_exit", "free_port", "launcher_process",
           "log_name", "ready_line", "resolve_runtime", "run_launcher", "serve",
           "sweep_dead_at_start", "wall_clock"]
