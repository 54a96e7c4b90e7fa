"""Backend choice, preflight errors before any process group, EP + EPLB groups on 2 ranks."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from xllm_eplb.config import Config, EplbConfig, ModelConfig, RuntimeConfig, resolve_backend
from xllm_eplb.errors import ConfigError
from xllm_eplb.worker import comm


@pytest.mark.parametrize("device,backend,want", [
    ("cpu", "auto", "gloo"), ("cuda", "auto", "nccl"), ("npu", "auto", "hccl"),
    ("cpu", "gloo", "gloo"), ("cuda", "nccl", "nccl"), ("npu", "hccl", "hccl"),
])
def test_resolve_backend(device, backend, want):
    assert resolve_backend(device, backend) == want


@pytest.mark.parametrize("device,backend", [("cpu", "nccl"), ("cuda", "hccl"), ("npu", "gloo")])
def test_backend_device_mismatch(device, backend):
    with pytest.raises(ConfigError, match=f"backend={backend} cannot drive device={device}"):
        resolve_backend(device, backend)


def _cfg(**rt) -> Config:
    return Config(eplb=EplbConfig(ep_size=2), model=ModelConfig(num_experts=8),
                  runtime=RuntimeConfig(**rt))


def test_preflight_errors_before_any_group():
    try:
        import torch_npu  # noqa: F401
        has_npu = True
    except ImportError:
        has_npu = False
    if not has_npu:
        with pytest.raises(ConfigError, match="device=npu needs the torch_npu package"):
            comm.init_groups(_cfg(device="npu"), 0, 2, init_method="tcp://127.0.0.1:1")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device=cuda but torch sees no CUDA device"):
            comm.preflight(_cfg(device="cuda"))
    with pytest.raises(ConfigError, match="world size 3 differs from ep_size=2"):
        comm.init_groups(_cfg(), 0, 3, init_method="tcp://127.0.0.1:1")
    bad = replace(_cfg(), model=ModelConfig(num_experts=9))
    with pytest.raises(ConfigError, match="--num_experts=9: must be divisible by --ep_size=2"):
        comm.init_groups(bad, 0, 2, init_method="tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="master_port=0"):
        comm.init_groups(_cfg(), 0, 2)
    assert not dist.is_initialized()


def _child(rank, init, q):
    try:
        torch.set_num_threads(1)
        g = comm.init_groups(_cfg(), rank, 2, init_method=init, timeout_s=30)
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x, group=g.eplb_group)
        y = torch.tensor([10.0 * (rank + 1)])
        dist.all_reduce(y, group=g.ep_group)
        q.put((rank, g.backend, str(g.device), x.item(), y.item(), g.eplb_group is not g.ep_group))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, "error", repr(e), 0, 0, False))
    finally:
        comm.destroy()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_init_groups_two_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path / 'rdv'}"
    ps = [ctx.Process(target=_child, args=(r, init, q), daemon=True) for r in range(2)]
    for p in ps:
        p.start()
    try:
        got = sorted(q.get(timeout=50) for _ in range(2))
    finally:
        for p in ps:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert got == [(0, "gloo", "cpu", 3.0, 30.0, True), (1, "gloo", "cpu", 3.0, 30.0, True)]
