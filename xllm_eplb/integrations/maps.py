"""DeepSeek's return format from a physical->logical map (vectorised over layers).

``log2phy [L, E, X]``: the slots of expert ``e``, ascending, left-packed, ``-1``-padded, with ``X``
the largest replica count over all layers; ``logcnt [L, E]`` replica counts (rows sum to R).
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import log2phy, replica_counts


def logical_maps(phy2log: np.ndarray, num_logical: int) -> tuple[np.ndarray, np.ndarray]:
    """phy2log int64 [L, R] -> (log2phy int64 [L, E, X], logcnt int64 [L, E]) (the toolkit's
    :func:`~xllm_eplb.eplb.placement.log2phy` and ``replica_counts``)."""
    p = np.asarray(phy2log, dtype=np.int64)
    return log2phy(p, num_logical), replica_counts(p, num_logical)


def check_triple(phy2log, log2phy, logcnt, num_logical: int) -> list[str]:
    """Every rule DeepSeek's callers assume, as a list of violations (empty = consistent):
    int64, logcnt >= 1 and = the replica counts, log2phy left-packed, -1-padded, and its
    entries exactly the slots of each expert."""
    bad = []
    p, l2p, c = (np.asarray(x) for x in (phy2log, log2phy, logcnt))
    for name, a in (("phy2log", p), ("log2phy", l2p), ("logcnt", c)):
        if a.dtype != np.int64:
            bad.append(f"{name} dtype {a.dtype} (int64 expected)")
    if (c < 1).any():
        bad.append("an expert has logcnt < 1")
    for i in range(p.shape[0]):
        if not np.array_equal(replica_counts(p[i], num_logical), c[i]):
            bad.append(f"layer {i}: logcnt differs from the replica counts of phy2log")
        valid = l2p[i] >= 0
        if not np.array_equal(valid.sum(axis=1), c[i]):
            bad.append(f"layer {i}: log2phy valid entries differ from logcnt")
        if (valid[:, 1:] & ~valid[:, :-1]).any():
            bad.append(f"layer {i}: log2phy is not left-packed")
        e, _ = np.nonzero(valid)
        if not np.array_equal(p[i][l2p[i][valid]], e):
            bad.append(f"layer {i}: log2phy points at slots of other experts")
    return bad
