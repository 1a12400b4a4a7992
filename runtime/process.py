"""The process group, devices and device meshes a compiled model runs on."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.mesh import Mesh


class CompileError(RuntimeError):
    """The model, mesh, plan or process group do not fit together; the message says how."""


def ensure_process_group() -> None:
    """Initialise torch.distributed from torchrun's environment if nobody has yet."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise CompileError("autopar.compile needs a process group: run under torchrun "
                           "(torchrun --nproc_per_node N script.py) or call torch.distributed.init_process_group")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def device_of(device_type: str) -> torch.device:
    """This rank's device: its CUDA device under NCCL, else the CPU."""
    return torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


_MESHES: dict = {}


def device_mesh(device_type: str, mesh: Mesh):
    """One DeviceMesh per (device, shape, names): process groups are made once."""
    key = (device_type, mesh.shape, mesh.axis_names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)
    return _MESHES[key]
