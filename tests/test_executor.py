"""EplbExecutor with the real model on 4 gloo ranks: overlap semantics, deferral, failures."""

import logging
import time

import numpy as np
import pytest
import torch
from migration_util import four_rank_results, perturb, tiny_cfg, with_eplb

from xllm_eplb.eplb.info import EplbInfo

pytestmark = pytest.mark.slow   # starts other processes (make test-fast skips it)


def _recording_hooks():
    from xllm_eplb.worker.migration import ModelEplbHooks

    class RecordingHooks(ModelEplbHooks):
        """The real hooks, plus an event log and an injectable prepare failure."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.events = []
            self.raise_on_prepare = False

        def prepare_expert_weight(self, layer, expert_ids):
            self.events.append(f"prepare:{layer}")
            if self.raise_on_prepare:
                raise RuntimeError("injected prepare failure")
            return super().prepare_expert_weight(layer, expert_ids)

        def start_expert_weight_transfer(self, layer):
            self.events.append(f"start:{layer}")
            super().start_expert_weight_transfer(layer)

        def update_expert_weight(self, layer):
            self.events.append(f"finish:{layer}")
            return super().update_expert_weight(layer)

    return RecordingHooks


def _wait_token(ex, timeout=10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        t = ex.consume_ready_token()
        if t != -1:
            return t
        time.sleep(0.005)
    return -1


def _wait_stat(ex, key, value, timeout=10.0):
    t0 = time.monotonic()
    while getattr(ex.stats(), key) < value and time.monotonic() - t0 < timeout:
        time.sleep(0.005)
    return getattr(ex.stats(), key)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _batch(rank):
    from xllm_eplb.model.batch import RankBatch, SeqRow

    rng = np.random.default_rng(rank)
    return RankBatch([SeqRow(req_id=rank * 10 + i, token_ids=rng.integers(0, 256, 6).tolist(),
                             start_pos=0, is_prefill=True) for i in range(3)])


def _rank_main(rank, world):
    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.worker.comm import groups_from_world
    from xllm_eplb.worker.executor import EplbExecutor, make_executor

    cap = _Capture()
    logging.getLogger("xllm_eplb.worker").addHandler(cap)
    logging.getLogger("xllm_eplb.worker").setLevel(logging.INFO)
    cfg = with_eplb(tiny_cfg(ep_size=world), eplb_heartbeat_seconds=0.05)
    groups = groups_from_world(cfg)
    model = Decoder(cfg, rank, groups.ep_group)
    hooks = _recording_hooks()(model, groups.eplb_group, cfg, canary=True)
    ex = EplbExecutor(hooks, cfg)
    batch = _batch(rank)

    def forward(info=None):
        ex.before_forward(info or EplbInfo())
        out = model.forward_step(batch, warmup=True, return_logits=True).logits
        ex.after_forward()
        return out

    base = forward()
    E, S = cfg.model.num_experts, cfg.slots_per_rank
    moes = model.moe_layers
    old0 = moes[0].global_phy2log.copy()
    new0 = perturb(np.random.default_rng(7), np.roll(old0, S), E, world, S, 2)
    new1 = np.roll(moes[1].global_phy2log, 2 * S)

    # prepare layer 0 (token 7): the forward carrying it is unaffected
    assert torch.equal(forward(EplbInfo(prepare_layer_id=0, prepare_token=7, expert_ids=new0)),
                       base)
    assert _wait_token(ex) == 7
    assert ex.consume_ready_token() == -1                       # reported exactly once

    # activate layer 0 together with the prepare of layer 1 (token 8): deferred
    hooks.events.clear()
    w13_before = moes[0].w13.clone()
    ex.before_forward(EplbInfo(prepare_layer_id=1, prepare_token=8, expert_ids=new1,
                               update_layer_id=0, activation_token=7))
    assert hooks.events == ["start:0"]
    mid = model.forward_step(batch, warmup=True, return_logits=True).logits
    assert torch.equal(mid, base)                               # overlapping forward: old weights
    assert torch.equal(moes[0].w13, w13_before)
    assert moes[0].global_phy2log.tolist() == old0.tolist()
    ex.after_forward()
    assert moes[0].global_phy2log.tolist() == new0.tolist()
    assert _wait_token(ex) == 8
    assert hooks.events == ["start:0", "finish:0", "prepare:1"]
    assert not torch.equal(moes[0].w13, w13_before)
    assert torch.equal(forward(), base)                         # new placement, same outputs
    # activate layer 1 (no prepare with it)
    t_act = time.time()
    assert torch.equal(forward(EplbInfo(update_layer_id=1, activation_token=8)), base)
    assert ex.stats().p2p_heartbeat_ts >= t_act             # the P2P path reported its work
    assert moes[1].global_phy2log.tolist() == new1.tolist()
    assert torch.equal(forward(), base)

    # failed prepares are never reported ready
    bad = moes[0].global_phy2log.copy()
    bad[bad == 5] = 6                                           # expert 5 missing
    forward(EplbInfo(prepare_layer_id=0, prepare_token=9, expert_ids=bad))
    assert _wait_stat(ex, "prepares_failed", 1) == 1
    hooks.raise_on_prepare = True
    forward(EplbInfo(prepare_layer_id=1, prepare_token=10, expert_ids=new1))
    assert _wait_stat(ex, "prepares_failed", 2) == 2
    assert ex.consume_ready_token() == -1
    hooks.raise_on_prepare = False
    time.sleep(0.15)                                            # a few heartbeats
    st = ex.stats()
    ex.close()
    null = make_executor(model, groups.eplb_group, with_eplb(cfg, enable_eplb=False))
    null.before_forward(EplbInfo())
    null.after_forward()
    assert null.consume_ready_token() == -1 and null.stats().activations == 0
    assert null.stats().p2p_heartbeat_ts == 0                # no P2P path: no heartbeat
    logging.getLogger("xllm_eplb.worker").removeHandler(cap)
    return st, cap.lines


@pytest.mark.timeout(180)
def test_executor_overlap_deferral_and_failures():
    out = four_rank_results()["executor"]
    for st, lines in out:
        assert st.prepares_ok == 2 and st.prepares_failed == 2
        assert st.activations == 2 and st.last_update_layer == 1
        assert st.slots_changed_total > 0 and st.p2p_bytes_total > 0
        assert st.p2p_heartbeat_ts > 0 and st.heartbeat_ts > 0
        assert any(s.startswith("EPLB staging reservation warmed bytes=") for s in lines)
        assert sum(s.startswith("update_expert_weight layer=") for s in lines) == 2
        assert sum(s.startswith("prepare_expert_weight layer=") for s in lines) == 2
        failed = [s for s in lines if s.startswith("prepare_expert_weight failed")]
        assert len(failed) == 2
        assert "token=9" in failed[0] and "has no replica" in failed[0]
        assert "token=10" in failed[1] and "injected prepare failure" in failed[1]
        assert any(s.startswith("EPLB heartbeat executor_thread") for s in lines)
        assert any(s.startswith("EPLB heartbeat p2p_bucket rank=") for s in lines)
    assert sum(st.p2p_bytes_total for st, _ in out) > 0
