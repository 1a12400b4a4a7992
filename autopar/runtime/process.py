"""The process group, devices and device meshes a compiled model runs on."""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.mesh import Mesh

from autopar.runtime.checks.faults import DEFAULT_TIMEOUT_S

log = logging.getLogger("autopar")


class CompileError(RuntimeError):
    """The model, mesh, plan or process group do not fit together; the message says how."""


def ensure_process_group() -> None:
    """Initialise torch.distributed from torchrun's environment if nobody has yet."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise CompileError("autopar.compile needs a process group: run under torchrun "
                           "(torchrun --nproc_per_node N script.py) or call torch.distributed.init_process_group")
    init_process_group()


def init_process_group(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """torch.distributed.init_process_group from torchrun's environment (NCCL with CUDA,
    else gloo), such that the job can be restarted by torchrun (--max-restarts).

    torchrun keeps one key-value store for the whole job; a restarted attempt reads the
    addresses the dead attempt's ranks published there and fails to connect ("Gloo
    connectFullMesh failed ... Connection refused").  Here each attempt works under its own
    prefix of that store (TORCHELASTIC_RESTART_COUNT), so a restart meets only its own
    ranks.  Across nodes each agent counts its own restarts, so the count cannot name an
    attempt: there torchrun must give each attempt a fresh store
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, with --rdzv-backend c10d),
    which workers see as TORCHELASTIC_USE_AGENT_STORE=False.  Outside torchrun's agent it
    is the plain env:// initialisation."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    delta = datetime.timedelta(seconds=float(timeout))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if not agent_store or "MASTER_ADDR" not in os.environ or nodes > 1:
        if agent_store and nodes > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            log.warning("torchrun shares one store across the restarts of this %d-node job, and a restarted "
                        "attempt may fail to connect ('Gloo connectFullMesh failed'); launch torchrun with "
                        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment", nodes)
        dist.init_process_group(backend, timeout=delta)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=delta)
    store = dist.PrefixStore(f"autopar/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=delta)


def device_of(device_type: str) -> torch.device:
    """This rank's device: its CUDA device under NCCL, else the CPU."""
    return torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


_MESHES: dict = {}   # the process's DeviceMeshes, so process groups are made once


def device_mesh(device_type: str, mesh: Mesh):
    """One DeviceMesh per (device, shape, names)."""
    key = (device_type, mesh.shape, mesh.axis_names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)
    return _MESHES[key]


STAGE_AXIS = "_stage"  # the device-group dimension added in front of the mesh's own axes


def group_mesh(device_type: str, mesh: Mesh, axis: str, groups: int):
    """A DeviceMesh of shape (groups, *per-stage shape) named (STAGE_AXIS, *mesh.axis_names):
    device group g holds the ranks whose coordinate on `axis` lies in [g*q, (g+1)*q),
    q = shape[axis] / groups.  Made once per process, as device_mesh's."""
    key = (device_type, mesh.shape, mesh.axis_names, axis, groups)
    if key not in _MESHES:
        a = mesh.axis_names.index(axis)
        q = mesh.shape[a] // groups
        ranks = torch.arange(mesh.size).reshape(mesh.shape)
        ranks = ranks.reshape(mesh.shape[:a] + (groups, q) + mesh.shape[a + 1:]).movedim(a, 0)
        _MESHES[key] = DeviceMesh(device_type, ranks, mesh_dim_names=(STAGE_AXIS, *mesh.axis_names))
    return _MESHES[key]
