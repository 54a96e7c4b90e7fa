"""DeepSeek's published EPLB algorithm, written here from its description (README of
deepseek-ai/EPLB; no code of the original is copied): the baseline of the tests and of
``scripts/bench_policy.py``, and the fallback of :func:`xllm_eplb.integrations.deepseek.
rebalance_experts` when our planner fails (the "host default" of DeepSeek's interface).

The algorithm, per layer:

- *global* (``num_groups % num_nodes != 0``, run as one group on one node) or *hierarchical*:
  1. pack expert groups onto nodes (``balanced_packing``: heaviest group first into the lightest
     node that still has room; equal group count per node);
  2. inside each node, give its ``R / nodes`` slots to the experts by repeatedly adding a replica
     to the expert with the largest load per replica (``replicate``);
  3. pack each node's replicas (load split evenly) onto its GPUs with ``balanced_packing``.
- outputs: ``phy2log [L, R]`` rank-major (GPU g owns slots ``g*R/P .. (g+1)*R/P - 1``, inside a GPU
  in packing order), ``log2phy [L, E, X]`` -1-padded with replica ``r`` of an expert in column
  ``r`` (``X`` = max replica count over all layers), ``logcnt [L, E]``; int64.

Replicas are packed like any other item, so two replicas of one expert may share a GPU.
Sorting uses a stable order (ties: lower index first); the original's tie order may differ.
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """weight [n, m] (m divisible by num_packs) -> (pack index [n, m], rank in pack [n, m]):
    each row's items, heaviest first, go to the lightest pack with fewer than m / num_packs
    items (ties: lowest pack)."""
    n, m = weight.shape
    per = m // num_packs
    if per == 1:
        return (np.broadcast_to(np.arange(m), (n, m)).copy(), np.zeros((n, m), dtype=np.int64))
    pack = np.empty((n, m), dtype=np.int64)
    rank = np.empty((n, m), dtype=np.int64)
    for i in range(n):
        load = np.zeros(num_packs)
        items = np.zeros(num_packs, dtype=np.int64)
        for g in np.argsort(-weight[i], kind="stable"):
            p = int(np.argmin(np.where(items < per, load, np.inf)))
            pack[i, g], rank[i, g] = p, items[p]
            load[p] += weight[i, g]
            items[p] += 1
    return pack, rank


def replicate(weight: np.ndarray, num_phy: int):
    """weight [n, m] -> (phy2log [n, num_phy], replica rank [n, num_phy], count [n, m]):
    slot j < m holds expert j; each further slot gets the expert with the largest load per
    replica (ties: lowest id)."""
    n, m = weight.shape
    phy = np.tile(np.arange(num_phy), (n, 1))
    rank = np.zeros((n, num_phy), dtype=np.int64)
    cnt = np.ones((n, m), dtype=np.int64)
    rows = np.arange(n)
    for j in range(m, num_phy):
        e = np.argmax(weight / cnt, axis=1)
        phy[:, j], rank[:, j] = e, cnt[rows, e]
        cnt[rows, e] += 1
    return phy, rank, cnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), 1)
    return inv


def _hierarchical(w: np.ndarray, num_phy: int, groups: int, nodes: int, gpus: int):
    layers, num_e = w.shape
    gsize, gpn = num_e // groups, gpus // nodes
    per_gpu = num_phy // gpus
    gpack, grank = balanced_packing(w.reshape(layers, groups, gsize).sum(axis=2), nodes)
    # logical -> "node-major" index: the experts of node 0 first, in group order
    log2mlog = (((gpack * (groups // nodes) + grank) * gsize)[:, :, None]
                + np.arange(gsize)).reshape(layers, num_e)
    mlog2log = _inverse(log2mlog)
    wm = np.take_along_axis(w, mlog2log, 1).reshape(layers * nodes, num_e // nodes)
    phy2mlog, phyrank, mlogcnt = replicate(wm, num_phy // nodes)
    per_phy = np.take_along_axis(wm / mlogcnt, phy2mlog, 1)
    pack, rank_in = balanced_packing(per_phy, gpn)
    pphy2phy = _inverse(pack * per_gpu + rank_in)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, 1).reshape(layers, nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(nodes) * (num_e // nodes))[None, :, None]).reshape(
        layers, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, 1)
    rank = np.take_along_axis(phyrank, pphy2phy, 1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, 1)
    return phy2log, rank, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int):
    """DeepSeek's entry point (see module doc). weight [L, E] (array-like, any numeric type)
    -> (phy2log [L, R], log2phy [L, E, X], logcnt [L, E]), int64 numpy arrays."""
    w = np.asarray(weight, dtype=np.float64)
    layers, num_e = w.shape
    if num_replicas % num_gpus or num_gpus % num_nodes:
        raise AssertionError(f"num_replicas={num_replicas} must be a multiple of "
                             f"num_gpus={num_gpus}, and num_gpus of num_nodes={num_nodes}")
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    width = int(logcnt.max())
    log2phy = np.full((layers, num_e * width), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * width + rank,
                      np.broadcast_to(np.arange(num_replicas), phy2log.shape), 1)
    return phy2log, log2phy.reshape(layers, num_e, width), logcnt
