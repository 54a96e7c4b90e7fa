"""Helpers shared by the migration and executor tests: a tiny config and random placements."""

from __future__ import annotations

import dataclasses

import numpy as np

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.eplb import placement
from xllm_eplb.model.default_checkpoint import with_default_checkpoint


def tiny_cfg(ep_size: int = 4, redundant: int = 2, **eplb) -> Config:
    """8 experts, 2 MoE layers, hidden 8, float64 (exact comparisons), served from the
    generated checkpoint of these sizes (written once into the cache by the first caller: the
    parent process, before it spawns ranks)."""
    return with_default_checkpoint(Config(
        eplb=EplbConfig(enable_eplb=True, ep_size=ep_size, redundant_experts_num=redundant,
                        eplb_canary=True, **eplb),
        model=ModelConfig(num_layers=3, first_k_dense_replace=1, num_experts=8,
                          num_experts_per_tok=2, hidden_size=8, moe_intermediate_size=4,
                          intermediate_size=16, num_attention_heads=2, vocab_size=261,
                          max_position_embeddings=64, dtype="float64")))


def with_eplb(cfg: Config, **changes) -> Config:
    return dataclasses.replace(cfg, eplb=dataclasses.replace(cfg.eplb, **changes))


def random_placement(rng, E: int, D: int, S: int) -> np.ndarray:
    """A strict placement: every expert present, at most one replica per rank. int64 [D*S]."""
    k = E // D
    perm = rng.permutation(E)
    rows = []
    for r in range(D):
        row = [int(e) for e in perm[r * k:(r + 1) * k]]
        others = [e for e in range(E) if e not in row]
        row += [int(e) for e in rng.choice(others, S - k, replace=False)]
        rng.shuffle(row)
        rows.append(row)
    return np.array(rows, dtype=np.int64).reshape(-1)


def _valid(p, E, D) -> bool:
    try:
        placement.validate_phy2log(p, E, D)
        return True
    except placement.PlacementError:
        return False


def perturb(rng, p: np.ndarray, E: int, D: int, S: int, n_ops: int) -> np.ndarray:
    """Apply ``n_ops`` random valid edits: cross-rank swaps, in-rank swaps, replica changes."""
    q = p.copy()
    for _ in range(n_ops):
        for _try in range(20):
            c = q.copy()
            op = rng.integers(3)
            a = int(rng.integers(D * S))
            if op == 0:                                   # swap with any slot
                b = int(rng.integers(D * S))
                c[a], c[b] = c[b], c[a]
            elif op == 1:                                 # swap within a's rank
                b = (a // S) * S + int(rng.integers(S))
                c[a], c[b] = c[b], c[a]
            else:                                         # replica count change
                c[a] = int(rng.integers(E))
            if _valid(c, E, D):
                q = c
                break
    return q


def all_changed(rng, p: np.ndarray, E: int, D: int, S: int) -> np.ndarray:
    """A strict placement in which every slot differs from ``p``."""
    for _ in range(10000):
        q = random_placement(rng, E, D, S)
        if (q != p).all():
            return q
    raise AssertionError("no all-changed placement found")


def placement_sequence(seed: int, n: int, E: int, D: int, S: int, start: np.ndarray):
    """``n`` successive target placements from ``start``: identity, every slot changed,
    small and large perturbations, fresh random ones (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    cur = start.copy()
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            nxt = cur.copy()
        elif kind == 1:
            nxt = all_changed(rng, cur, E, D, S)
        elif kind in (2, 3):
            nxt = perturb(rng, cur if _valid(cur, E, D) else random_placement(rng, E, D, S),
                          E, D, S, int(rng.integers(1, 4)))
        else:
            nxt = random_placement(rng, E, D, S)
        out.append(nxt)
        cur = nxt
    return out


def _both(rank: int, world: int):
    import test_executor
    import test_migration

    return {"migration": test_migration._rank_main(rank, world),
            "executor": test_executor._rank_main(rank, world)}


_RESULTS: dict = {}


def four_rank_results(timeout: float = 150.0) -> dict:
    """Run the migration and the executor scenarios in ONE spawn of 4 gloo ranks (process
    start-up dominates on a small machine) and cache the per-rank results for both test files.
    Returns {"migration": [per rank], "executor": [per rank]}."""
    if not _RESULTS:
        from xllm_eplb.testing.dist import run_ranks

        tiny_cfg()                      # the checkpoint is generated here, never per rank
        out = run_ranks(_both, 4, timeout=timeout)
        _RESULTS.update(migration=[o["migration"] for o in out],
                        executor=[o["executor"] for o in out])
    return _RESULTS
