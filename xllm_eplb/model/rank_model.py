"""``RankModel``: what an EP rank's model shares whatever its layers (the checkpoint
``Decoder``): slot count, releasing finished requests, truncating a request's KV cache (elastic recovery), the
dispatch-mode choice.

A subclass sets ``cfg``, ``kv`` (with ``release(req_id)``), ``fused_failure`` (why the fused
path cannot run here, or "") and ``_fallback_logged = False``.
"""

from __future__ import annotations

import logging

from xllm_eplb.model import dispatch as dsp

log = logging.getLogger(__name__)


class RankModel:
    """Mixin of the per-rank model's non-layer behaviour (see the module docstring)."""

    @property
    def slots_per_rank(self) -> int:
        return self.cfg.slots_per_rank

    def release(self, req_ids) -> None:
        """Free the KV cache of finished requests."""
        for r in req_ids:
            self.kv.release(int(r))

    def truncate(self, cuts) -> None:
        """Cut requests' KV caches back: ``cuts`` = ``[[req_id, length], ...]``
        (``RankBatch.truncate``)."""
        for r, n in cuts:
            self.kv.truncate(int(r), int(n))

    def dispatch_mode(self, pure_decode: bool) -> str:
        """The dispatch path of this step; a requested fused path that cannot run here is
        logged once and falls back to plain."""
        e = self.cfg.eplb
        mode, why = dsp.resolve_dispatch_mode(e.expert_parallel_degree, e.enable_fused_mc2,
                                              pure_decode=pure_decode,
                                              precondition_failure=self.fused_failure)
        if why and not self._fallback_logged:
            self._fallback_logged = True
            log.warning("EPLB dispatch fallback requested=fused used=plain reason=%s",
                        why.replace(" ", "_"))
        return mode
