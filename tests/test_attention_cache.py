"""``attention.attend`` reading the KV cache through a view (consecutive slots) or a gather
(any slots), grouped-query heads without repetition, against a plain float64 attention."""

from __future__ import annotations

import math

import torch

from xllm_eplb.model.attention import AttnBatch, KVCache, attend


def _naive(qs, ks, vs, scale):
    """One request: q [n, h, d] at the last n of P positions, k/v [P, kvh, d] -> [n, h, d]."""
    n, h, _ = qs.shape
    P, kvh = ks.shape[0], ks.shape[1]
    rep = h // kvh
    out = torch.empty_like(qs)
    for j in range(n):
        seen = P - n + j + 1
        for a in range(h):
            s = (ks[:seen, a // rep] @ qs[j, a]) * scale
            out[j, a] = torch.softmax(s, 0) @ vs[:seen, a // rep]
    return out


def _run(slot_order):
    torch.manual_seed(0)
    h, kvh, d, scale = 4, 2, 8, 1 / math.sqrt(8)
    cache = KVCache(2, kvh, d, d, 64, torch.float64, torch.device("cpu"), slots=2, cap=2)
    hist = {}
    for r in slot_order:                        # slots handed out in this request order
        cache.reserve([r], [3])
    for lens, starts in [([3, 3, 3], [0, 0, 0]), ([1, 1, 1], [3, 3, 3])]:
        rids = [0, 1, 2]
        slots = cache.reserve(rids, [s + n for s, n in zip(starts, lens, strict=True)])
        spans, t = [], 0
        for n in lens:
            spans.append((t, n))
            t += n
        ab = AttnBatch(spans, starts, slots, torch.device("cpu"))
        q = torch.randn(t, h, d, dtype=torch.float64)
        k = torch.randn(t, kvh, d, dtype=torch.float64)
        v = torch.randn(t, kvh, d, dtype=torch.float64)
        out = attend(cache, ab, 1, q, k, v, scale)
        for r, (a, n) in enumerate(spans):
            hk, hv = hist.get(r, (k[:0], v[:0]))
            hist[r] = (torch.cat([hk, k[a:a + n]]), torch.cat([hv, v[a:a + n]]))
            want = _naive(q[a:a + n], *hist[r], scale)
            torch.testing.assert_close(out[a:a + n], want, rtol=1e-12, atol=1e-12)
        cache.advance(rids, [s + n for s, n in zip(starts, lens, strict=True)])
    return ab


def test_consecutive_slots_read_through_a_view():
    ab = _run([0, 1, 2])
    assert ab.first_slot == 0


def test_scattered_slots_gather_and_growth():
    ab = _run([2, 0, 1])                 # requests 0, 1, 2 hold slots 1, 2, 0; both axes grow
    assert ab.first_slot is None


def test_first_slot_only_for_consecutive_slots():
    dev = torch.device("cpu")
    assert AttnBatch([(0, 1), (1, 1)], [0, 0], [3, 4], dev).first_slot == 3
    assert AttnBatch([(0, 1), (1, 1)], [0, 0], [4, 3], dev).first_slot is None
