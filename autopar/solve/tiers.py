"""Memory tiers in a plan: what the offloaded optimizer states take of each device's host
memory and disk, and a plan kept within them.

The ILP prices a parameter's states on the device, in host memory or on disk (menus:
`Strategy.offload`); its budget constraint counts device bytes only, where host and disk
choices both take none.  Host memory is the cheaper tier (no disk reads and writes), so
the solve fills it first; when the chosen plan's host bytes pass the device's share of the
node's memory (`DeviceSpec.host_memory`), the largest parameters are refused the host
tier and the plan is solved again, their states then going to disk or staying on the
device, whichever the ILP prices lower.  A plan whose disk bytes pass
`DeviceSpec.disk_memory` is infeasible, with an error that says by how much.
"""
from __future__ import annotations

import logging
import math

from autopar.cost import prices as C
from autopar.solve.presolve import InfeasibleError

log = logging.getLogger("autopar")

class TierCapacityError(InfeasibleError):
    """The plan's offloaded states pass a tier's capacity (the message says which and by how much)."""


# At most this many solves refusing more parameters the host tier.
ROUNDS = 4


def offloaded(problem, choice) -> dict:
    """Parameter name -> (tier, bytes per device) of every parameter whose states `choice`
    offloads."""
    mesh = problem.mesh
    mixed = problem.precision is not None
    out = {}
    for pn in problem.nodes:
        if pn.kind != "param" or not pn.requires_grad:
            continue
        s = problem.nodes[pn.rep].strategies[choice[pn.index]]
        if not s.offload:
            continue
        numel = C.local_numel(pn.out_shapes[0], s.outputs[0], mesh.shape)
        owned = math.ceil(numel / math.prod(mesh.shape[a] for a in s.zero_axes)) if s.zero else numel
        out[pn.param_name] = (s.offload, owned * C.offloaded_bytes(pn.out_dtypes[0].itemsize, mixed))
    return out


def tier_bytes(problem, choice) -> dict:
    """{"host": bytes, "disk": bytes} per device that `choice` keeps off the device."""
    total = {"host": 0.0, "disk": 0.0}
    for tier, nbytes in offloaded(problem, choice).values():
        total[tier] += nbytes
    return total


def refusing_host(rule, names: frozenset):
    """`rule` (an allowed(problem, pn, strategy) function, or None for every choice) with
    the host tier refused to the parameters `names`."""
    def allowed(problem, pn, strategy) -> bool:
        if pn.kind == "param" and strategy.offload == "host" and pn.param_name in names:
            return False
        return rule is None or rule(problem, pn, strategy)
    return allowed


def within_tiers(problem, best, rule, solve):
    """`best` (a Solved), or the plan solve(rule') gives once the parameters whose states
    pass the host memory are refused that tier (see the module docstring)."""
    device = problem.mesh.device
    refused = frozenset()
    for _ in range(ROUNDS):
        placed = offloaded(problem, best.choice)
        host = sum(b for tier, b in placed.values() if tier == "host")
        if device.host_memory <= 0 or host <= device.host_memory:
            break
        over = host - device.host_memory
        moved = []
        for name, (_, nbytes) in sorted(((n, v) for n, v in placed.items() if v[0] == "host"),
                                        key=lambda item: (-item[1][1], item[0])):
            if over <= 0:
                break
            moved.append(name)
            over -= nbytes
        refused |= frozenset(moved)
        log.info("offloaded states take %.2f GiB of host memory, more than the device's %.2f GiB: %d parameters "
                 "refused the host tier, solving again", host / 2**30, device.host_memory / 2**30, len(moved))
        best = solve(refusing_host(rule, refused))
    check_capacity(problem, best.choice)
    return best


def check_capacity(problem, choice) -> None:
    """InfeasibleError where `choice` keeps more in host memory or on disk than the device's tiers hold."""
    device = problem.mesh.device
    used = tier_bytes(problem, choice)
    gib = 2**30
    for tier, capacity, field in (("host", device.host_memory, "host_memory"), ("disk", device.disk_memory,
                                                                               "disk_memory")):
        if used[tier] > 0 and capacity > 0 and used[tier] > capacity:
            raise TierCapacityError(
                f"the plan keeps {used[tier] / gib:.2f} GiB of optimizer states per device in {tier} memory, more "
                f"than the {capacity / gib:.2f} GiB the device description gives ({device.name}.{field}); use more "
                f"devices (states shrink with ZeRO over more ranks), a larger memory_budget, or a device "
                f"description with more {tier} space (autopar calibrate --offload-dir measures the disk)")
