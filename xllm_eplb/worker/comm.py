"""Process groups of one worker: backend choice, the EP group and a separate EPLB group.

- backend ``auto`` picks gloo (device=cpu), nccl (cuda) or hccl (npu, via torch_npu): the rule
  is ``config.resolve_backend``;
- the EP group is the default world group (one process per EP rank; dispatch/combine run on it);
- the EPLB group is a second group over the same ranks (``dist.new_group``) used only for
  expert-weight moves, so P2P transfers never interleave with the MoE all_to_alls.

Every check that can fail on user input (device, backend, torch_npu, model shapes) runs in
:func:`preflight` before any process group exists. ``torch_npu`` is imported only when
``device=npu``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from xllm_eplb.config import Config, resolve_backend
from xllm_eplb.errors import ConfigError
from xllm_eplb.ipc.store import host_store, interface_of, store_client
from xllm_eplb.model.validate import validate_model_config


@dataclass
class CommGroups:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    ep_group: object      # the default (world) group
    eplb_group: object    # separate group for weight moves


def check_device(device: str) -> None:
    """ConfigError if the device's runtime is missing (torch_npu for npu, CUDA for cuda)."""
    if device == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError:
            raise ConfigError("--device=npu needs the torch_npu package, which is not installed "
                              "(install torch_npu or use device=cpu/cuda)") from None
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but torch sees no CUDA device (use --device=cpu)")


def device_for_rank(device: str, rank: int) -> torch.device:
    """cpu, or the rank's accelerator (``rank % device_count``)."""
    if device == "cuda":
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    if device == "npu":
        npu = torch.npu  # registered by torch_npu
        return torch.device("npu", rank % max(1, npu.device_count()))
    return torch.device("cpu")


def preflight(cfg: Config, world_size: int | None = None) -> str:
    """All user-input checks that must precede any process group. Returns the backend."""
    rt = cfg.runtime
    backend = resolve_backend(rt.device, rt.backend)
    if world_size is not None and world_size != cfg.eplb.ep_size:
        raise ConfigError(f"world size {world_size} differs from ep_size={cfg.eplb.ep_size} "
                          f"(one worker process per EP rank)")
    validate_model_config(cfg)
    check_device(rt.device)
    return backend


def init_groups(cfg: Config, rank: int, world_size: int, *, init_method: str | None = None,
                timeout_s: float | None = None) -> CommGroups:
    """Preflight, then create the default (EP) group and the EPLB group.

    ``init_method`` None: rank 0 hosts the group's store at ``master_addr:master_port``
    (port set by the launcher, not 0), listening on that address only
    (:func:`~xllm_eplb.ipc.store.host_store`; a ``tcp://`` init method would listen on every
    interface), the other ranks connect to it."""
    backend = preflight(cfg, world_size)
    rt = cfg.runtime
    device = device_for_rank(rt.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s or rt.worker_timeout_seconds)
    if init_method is not None:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
        return groups_from_world(cfg, device=device)
    if rt.master_port == 0:
        raise ConfigError("master_port=0: the launcher must pick a port before init_groups")
    nic = interface_of(rt.master_addr) if backend == "gloo" else None
    if nic:   # gloo listens where the host name resolves to: --master_addr's interface instead
        os.environ.setdefault("GLOO_SOCKET_IFNAME", nic)
    secs = timeout.total_seconds()
    store = (host_store(rt.master_addr, rt.master_port, secs) if rank == 0
             else store_client(rt.master_addr, rt.master_port, secs))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return groups_from_world(cfg, device=device)


def groups_from_world(cfg: Config, device: torch.device | None = None,
                      timeout: timedelta | None = None) -> CommGroups:
    """Groups for an already initialised default group (e.g. ``testing.dist.run_ranks``);
    ``timeout``: the EPLB group's (None: torch's default).

    NOTE: ``new_group`` is collective: every rank must call this, in the same order."""
    if not dist.is_initialized():
        raise RuntimeError("groups_from_world needs an initialised default process group")
    backend = str(dist.get_backend())
    eplb_group = dist.new_group(backend=backend, timeout=timeout)
    return CommGroups(dist.get_rank(), dist.get_world_size(), backend,
                      device or device_for_rank(cfg.runtime.device, dist.get_rank()),
                      dist.group.WORLD, eplb_group)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
