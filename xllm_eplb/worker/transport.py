"""Which transport carries a worker's dispatch and combine (``--ep_transport``, issue #39).

``shm``: the node's ranks exchange rows through the run's shared memory
(:class:`~xllm_eplb.ipc.alltoall.ShmAllToAll`), one segment per process-group generation
(``/xllm_eplb_<run>_a2a<g>``), so an elastic re-form gets fresh buffers; it applies on one node
(``--nnodes=1``), on ``device=cpu`` and on x86-64. ``auto`` (the default) is ``shm`` wherever it
applies. Anywhere else, and with ``dist``, the dispatch runs on the EP process group
(torch.distributed); an explicitly requested ``shm`` that does not apply is logged once with
the reason.
"""

from __future__ import annotations

import logging

from xllm_eplb.config import Config
from xllm_eplb.ipc.alltoall import ShmAllToAll, supported
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


def shm_unavailable(cfg: Config) -> str | None:
    """Why ``--ep_transport=shm`` cannot run here (None: it can)."""
    rt = cfg.runtime
    if rt.nnodes > 1:
        return f"nnodes={rt.nnodes}: ranks on other machines share no memory"
    if rt.device != "cpu":
        return f"device={rt.device}: rows live in device memory"
    if not supported():
        return "this CPU's memory ordering is not x86-64's (total store order)"
    return None


def uses_shm(cfg: Config, size: int) -> bool:
    """Do ``size`` EP ranks of this run exchange rows through the shared memory?"""
    return (cfg.runtime.ep_transport != "dist" and size > 1
            and shm_unavailable(cfg) is None)


def open_ep_transport(cfg: Config, run_id: str, generation: int, rank: int,
                      size: int) -> ShmAllToAll | None:
    """The shared-memory all-to-all of ``size`` ranks for this generation, or None (dist).

    Every rank of the group calls it with the same arguments but its own ``rank``. A round
    waits for a silent peer twice ``--worker_timeout_seconds``: the engine, whose wait for the
    step's outputs ends after one, is the one that names the silent rank (a rank that gave up
    first would be reported as the failure); a dead peer fails the round at once."""
    rt = cfg.runtime
    if rt.ep_transport == "dist" or size <= 1:
        return None
    why = shm_unavailable(cfg)
    if why:
        if rt.ep_transport == "shm":
            log.warning(event("EPLB ep transport fallback", requested="shm", used="dist",
                              reason=why.replace(" ", "_")))
        return None
    a2a = ShmAllToAll.open(run_id, generation, rank, size, rt.ep_shm_buffer_bytes,
                           2 * rt.worker_timeout_seconds)
    log.info(event("EPLB ep transport", used="shm", segment=a2a.seg.name, ranks=size,
                   buffer_bytes=rt.ep_shm_buffer_bytes))
    return a2a


def close_ep_transport(a2a: ShmAllToAll | None) -> None:
    """Close it (peers waiting on this rank fail their round at once); None: nothing."""
    if a2a is not None:
        a2a.close()
