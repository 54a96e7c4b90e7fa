"""The run's shared-memory rings as the launcher creates and finally closes them."""

from __future__ import annotations

import contextlib
import logging

from xllm_eplb.config import Config
from xllm_eplb.ipc.errors import SegmentBusyError
from xllm_eplb.ipc.ring import InputRing, OutputRing
from xllm_eplb.obs.logs import event
from xllm_eplb.preflight import StartupError

log = logging.getLogger(__name__)


class RunShm:
    """The run's rings, created (and finally unlinked) by the launcher: the input ring
    (engine -> every worker) and one output ring per worker. The engine attaches as producer
    of the input ring and reader of the output rings; workers attach the other ends."""

    def __init__(self, rings: list):
        self.rings = rings

    @classmethod
    def create(cls, cfg: Config, ranks: range | None = None) -> "RunShm":
        """The rings of ``ranks`` (default every EP rank; a node > 0 of a multi-node run: its
        own ranks): an input ring with one reader per rank and one output ring per rank."""
        rt = cfg.runtime
        ranks = range(cfg.eplb.ep_size) if ranks is None else ranks
        rings: list = []
        try:
            rings.append(InputRing.create(rt.run_id, len(ranks), rt.shm_ring_slots,
                                          rt.shm_input_frame_bytes, producer=False))
            for r in ranks:
                # NOTE: output frames carry a body checksum (small frames, ~1 us); the engine
                # reads them strictly, so a corrupt frame fails the step at once.
                rings.append(OutputRing.create(rt.run_id, r, rt.shm_ring_slots,
                                               rt.shm_output_frame_bytes, reader=False,
                                               checksum=True))
        except BaseException as e:
            cls(rings).close()
            if isinstance(e, SegmentBusyError):
                raise StartupError(f"--run_id={rt.run_id}: {e}") from None
            raise
        log.debug(event("launcher shm created", run_id=rt.run_id, rings=len(rings),
                       slots=rt.shm_ring_slots))
        return cls(rings)

    def close(self) -> None:
        for ring in self.rings:
            with contextlib.suppress(Exception):
                ring.close()
        self.rings = []

