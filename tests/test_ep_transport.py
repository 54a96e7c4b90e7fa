"""``--ep_transport`` (issue #39) in one process: where ``shm`` applies and why not elsewhere,
the flag's validation, and the shared-memory all-to-all's own checks (a one-rank group keeps
its rows, bad split sizes, a closed end, a second size for the same segment, nothing left)."""

from __future__ import annotations

import os

import pytest
import torch

from xllm_eplb.config import Config, EplbConfig, RuntimeConfig
from xllm_eplb.errors import ConfigError, LayoutError
from xllm_eplb.flags import config_from_dict
from xllm_eplb.ipc.alltoall import ShmAllToAll, segment_name, semaphore_name, supported
from xllm_eplb.ipc.objects import list_objects
from xllm_eplb.ipc.shm import shm_path
from xllm_eplb.worker.transport import open_ep_transport, shm_unavailable, uses_shm

needs_x86 = pytest.mark.skipif(not supported(), reason="shm all-to-all needs x86-64")


def _cfg(**rt) -> Config:
    return Config(eplb=EplbConfig(ep_size=2), runtime=RuntimeConfig(**rt))


def test_where_shm_applies():
    assert shm_unavailable(_cfg(nnodes=2)).startswith("nnodes=2")
    assert shm_unavailable(_cfg(device="cuda")).startswith("device=cuda")
    assert shm_unavailable(_cfg()) is None or not supported()
    # dist, a one-rank group, or shm where it cannot run: no transport (the EP group)
    assert open_ep_transport(_cfg(ep_transport="dist"), "t39u", 1, 0, 2) is None
    assert open_ep_transport(_cfg(ep_transport="shm"), "t39u", 1, 0, 1) is None
    assert open_ep_transport(_cfg(ep_transport="shm", nnodes=2), "t39u", 1, 0, 2) is None
    assert not list_objects("t39u")
    # auto (the default): shm wherever it applies, dist elsewhere
    assert RuntimeConfig().ep_transport == "auto"
    assert uses_shm(_cfg(), 2) == supported() and uses_shm(_cfg(ep_transport="shm"), 2) == supported()
    assert not uses_shm(_cfg(), 1) and not uses_shm(_cfg(ep_transport="dist"), 2)
    assert not uses_shm(_cfg(nnodes=2), 2) and not uses_shm(_cfg(device="cuda"), 2)


def test_flag_is_validated():
    with pytest.raises(ConfigError, match="ep_transport"):
        config_from_dict({"ep_size": 2, "ep_transport": "tcp"})
    with pytest.raises(ConfigError, match="ep_shm_buffer_bytes"):
        config_from_dict({"ep_size": 2, "ep_shm_buffer_bytes": 100})
    assert config_from_dict({"ep_size": 2, "ep_transport": "shm"}).runtime.ep_transport == "shm"


@needs_x86
def test_one_rank_keeps_its_rows_and_checks_its_input():
    run = f"t39o{os.getpid()}"
    with ShmAllToAll.open(run, 1, 0, 1, 4096, 5.0) as a2a:
        x = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
        out, got = a2a.all_to_all(x, [3])
        assert torch.equal(out, x) and got == [3] and out.dtype == torch.bfloat16
        out, got = a2a.all_to_all(x[:0], [0])
        assert out.shape == (0, 4) and got == [0]
        with pytest.raises(ValueError, match=r"send=\[2\] must have 1 entries summing to the 3"):
            a2a.all_to_all(x, [2])
        with pytest.raises(ValueError, match="hold no bytes"):
            a2a.all_to_all(torch.empty(2, 0), [2])
        # a second opener with another size sees a layout mismatch, never a resize
        with pytest.raises(LayoutError, match="object size"):
            ShmAllToAll.open(run, 1, 0, 1, 8192, 5.0)
    with pytest.raises(RuntimeError, match="closed"):
        a2a.all_to_all(x, [3])
    assert not os.path.exists(shm_path(segment_name(run, 1)))
    assert not os.path.exists(shm_path("sem." + semaphore_name(run, 1, 0).lstrip("/")))
    assert not list_objects(run)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"rank=2: must be in \[0, size=2\)"):
        ShmAllToAll.open("t39b", 1, 2, 2, 4096, 5.0)
    with pytest.raises(ValueError, match="cap_bytes=8"):
        ShmAllToAll.open("t39b", 1, 0, 2, 8, 5.0)
