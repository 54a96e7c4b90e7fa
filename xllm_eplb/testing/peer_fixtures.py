"""Peer test fixtures shared by the tests and ``testing/adapter_rows.py`` (facts from the
peers' published test set-ups, written here)."""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import replica_counts


def ascend_fixture(seed: int = 0, layers: int = 58, devices: int = 32, slots: int = 9,
                   experts: int = 256):
    """vllm-ascend's policy fixture shape: a current table [L, D, S] (each device: its share of a
    random permutation of the experts plus one redundant expert it does not hold) and per-slot
    workloads ``rand**10 * 999 + 1`` [L, D, S]."""
    rng = np.random.default_rng(seed)
    tab = np.empty((layers, devices, slots), np.int64)
    for i in range(layers):
        perm = rng.permutation(experts).reshape(devices, experts // devices)
        extra = [rng.choice(np.setdiff1d(np.arange(experts), perm[d])) for d in range(devices)]
        tab[i] = np.concatenate([perm, np.array(extra)[:, None]], axis=1)
    return tab, rng.random(tab.shape) ** 10 * 999 + 1


def slot_workload(table: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Per-slot workload of ``table`` [L, R] for expert loads [L, E]: each expert's load split
    evenly over its replicas (what vllm-ascend's per-slot counters would read). float [L, R]."""
    cnt = replica_counts(table, loads.shape[1])
    return np.take_along_axis(loads / cnt, table, 1)
