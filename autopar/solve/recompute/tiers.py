"""Memory tiers in a plan: what the offloaded optimizer states take of each device's host
memory and disk, and a plan kept within them.

The ILP prices a parameter's states on the device, in host memory or on disk (menus:
`Strategy.offload`); its budget constraint counts device bytes only, where host and disk
choices both take none.  Host memory is the cheaper tier (no disk reads and writes), so
the solve takes it wherever it offloads; when the chosen plan's host bytes pass the
device's share of the node's memory (`DeviceSpec.host_memory`), the plan is solved again
with offload priced at the disk's rates (what the bytes beyond host memory cost), and
host memory is then filled with the largest of the states it offloads (within_tiers).
A plan whose disk bytes pass `DeviceSpec.disk_memory` is infeasible, with an error that
says by how much.
"""
from __future__ import annotations

import dataclasses
import logging
import math

from autopar.cost import prices as C
from autopar import placements as P
from autopar.report.records import format_bytes
from autopar.solve.ilp.presolve import InfeasibleError
from autopar.solve.recompute.modes import mode_costs
from autopar.solve.ilp.solved import Assignment

log = logging.getLogger("autopar")


class TierCapacityError(InfeasibleError):
    """The plan's offloaded states pass a tier's capacity (the message says which and by how much)."""


def offloaded(problem, choice) -> dict:
    """Parameter name -> (tier, bytes per device kept there, bytes of gradient kept in host
    memory) of every parameter whose states `choice` offloads.  With its weights
    (Strategy.offload_weights) the tier also keeps the stored shard, and host memory its
    gradient."""
    mesh = problem.mesh
    mixed = problem.precision is not None
    out = {}
    for pn in problem.nodes:
        if pn.kind != "param" or not pn.requires_grad:
            continue
        s = problem.nodes[pn.rep].strategies[choice[pn.index]]
        if not s.offload:
            continue
        item = pn.out_dtypes[0].itemsize
        numel = P.local_numel(pn.out_shapes[0], s.outputs[0], mesh.shape)
        owned = math.ceil(numel / math.prod(mesh.shape[a] for a in s.zero_axes)) if s.zero else numel
        weights = numel * item if s.offload_weights else 0
        out[pn.param_name] = (s.offload, owned * C.offloaded_bytes(item, mixed) + weights, weights)
    return out


def tier_bytes(problem, choice) -> dict:
    """{"host": bytes, "disk": bytes} per device that `choice` keeps off the device."""
    total = {"host": 0.0, "disk": 0.0}
    for tier, nbytes, grads in offloaded(problem, choice).values():
        total[tier] += nbytes
        total["host"] += grads
    return total


def refusing_host(rule):
    """`rule` (an allowed(problem, pn, strategy) function, or None for every choice) with
    the host tier refused to every parameter."""
    def allowed(problem, pn, strategy) -> bool:
        if pn.kind == "param" and strategy.offload == "host":
            return False
        return rule is None or rule(problem, pn, strategy)
    return allowed


def within_tiers(problem, best, rule, solve):
    """`best` (a Solved) where its offloaded states fit the device's host memory; else the
    plan solve(rule') gives with every offloaded state priced on disk (the marginal tier
    once host memory is full), its largest states then moved to host memory as far as it
    holds them (the same layouts, each cheaper there: the device's memory is unchanged).
    Both solves have the problem's own shape (one tier on offer), which keeps them as
    quick as the first."""
    device = problem.mesh.device
    host = used_tiers(problem, best.choice)["host"]
    if device.host_memory <= 0 or host <= device.host_memory:
        check_capacity(problem, best.choice)
        return best
    log.info("offloaded states take %s of host memory, more than the device's %s: priced on disk, solving again",
             format_bytes(host), format_bytes(device.host_memory))
    best = solve(refusing_host(rule))
    choice = Assignment(best.choice, best.choice.modes)
    room = device.host_memory - used_tiers(problem, choice)["host"]
    moved = 0
    by_name = {pn.param_name: pn for pn in problem.nodes if pn.kind == "param"}
    for name, (tier, nbytes, _) in sorted(offloaded(problem, choice).items(), key=lambda kv: (-kv[1][1], kv[0])):
        pn = by_name[name]
        twin = host_twin(problem.nodes[pn.rep].strategies, choice[pn.index])
        if tier == "disk" and nbytes <= room and twin is not None and (rule is None or rule(
                problem, pn, problem.nodes[pn.rep].strategies[twin])):
            choice[pn.index] = twin
            room -= nbytes
            moved += 1
    log.info("%d parameters' states moved back to host memory (%s of it left)", moved, format_bytes(room))
    check_capacity(problem, choice)
    return dataclasses.replace(best, choice=choice)


def host_twin(strategies, index: int) -> int | None:
    """The index of the menu entry that stores the parameter as entry `index` does with
    its states in host memory (None if the menu has none)."""
    s = strategies[index]
    for j, other in enumerate(strategies):
        if other.offload == "host" and _stored_alike(s, other) and other.offload_weights == s.offload_weights:
            return j
    return None


def _stored_alike(a, b) -> bool:
    """Whether menu entries a and b lay the parameter and its ZeRO chunks out alike (they
    differ at most in what they offload)."""
    return a.outputs == b.outputs and a.zero == b.zero and a.zero_axes == b.zero_axes


def used_tiers(problem, choice) -> dict:
    """tier_bytes with the activations `choice`'s offloaded layers keep in host memory."""
    used = tier_bytes(problem, choice)
    modes = getattr(choice, "modes", None)
    if modes and "offload" in modes.values():
        used["host"] += mode_costs(problem, modes).host_bytes(problem, choice)
    return used


def check_capacity(problem, choice) -> None:
    """InfeasibleError where `choice` keeps more in host memory or on disk than the device's
    tiers hold (host memory: offloaded model states, the gradients of offloaded weights and
    the activations of layers offloaded to it)."""
    device = problem.mesh.device
    used = used_tiers(problem, choice)
    for tier, capacity, field in (("host", device.host_memory, "host_memory"), ("disk", device.disk_memory,
                                                                               "disk_memory")):
        if used[tier] > 0 and capacity > 0 and used[tier] > capacity:
            raise TierCapacityError(
                f"the plan keeps {format_bytes(used[tier])} per device in {tier} memory ("
                + (_host_parts(problem, choice, used[tier]) if tier == "host" else "offloaded model states")
                + f"), more than the {format_bytes(capacity)} the device description gives ({device.name}.{field}); "
                f"use more devices (states shrink with ZeRO over more ranks), a larger memory_budget, or a device "
                f"description with more {tier} space (autopar calibrate --offload-dir measures the disk)")


def _host_parts(problem, choice, total: float) -> str:
    """What a plan's host memory holds, named: the states kept there, the gradients of the
    weights kept off the device (in host memory while the optimizer steps, even where the
    weights and states live on disk: the disk tier needs that much host memory), and the
    activations of offloaded layers."""
    states = grads = 0.0
    for tier, nbytes, weight_grads in offloaded(problem, choice).values():
        states += nbytes if tier == "host" else 0.0
        grads += weight_grads
    parts = [f"model states {format_bytes(states)}"]
    if grads:
        parts.append(f"gradients of the weights kept off the device {format_bytes(grads)}, which stay in host "
                     f"memory even where the weights live on disk: with the disk tier this plan needs at least "
                     f"{format_bytes(grads)} of host memory")
    if total - states - grads > 0:
        parts.append(f"offloaded activations {format_bytes(total - states - grads)}")
    return "; ".join(parts)


def device_twins(strategies, index: int) -> list:
    """Menu entries that store the parameter as entry `index` does with less of it off the
    device: its states there without its weights (same tier), and all of it on the device."""
    s = strategies[index]
    out = []
    for j, other in enumerate(strategies):
        if not _stored_alike(s, other):
            continue
        if (other.offload == "" and not other.offload_weights) or (
                s.offload_weights and other.offload == s.offload and not other.offload_weights):
            out.append(j)
    return out


def fill_device(problem, best, rule, budget):
    """`best` with the memory its budget leaves used: the ILP gives identical layers one
    choice, so where offloading one layer's states (or weights) would have fitted but not
    keeping every layer's on the device, all are offloaded.  Parameters are taken back
    one by one, the most seconds saved per byte first, while the plan's memory (Solved.memory:
    the ILP's sum and what it needs beyond) stays within `budget`: a fraction of a set of
    identical parameters stays offloaded, the rest on the device.  None: no budget, nothing
    to fill."""
    if budget is None:
        return best
    slack = budget - best.memory
    if slack <= 0:
        return best
    moves = []
    for pn in problem.nodes:
        if pn.kind != "param":
            continue
        strategies = problem.nodes[pn.rep].strategies
        now = best.choice[pn.index]
        if not strategies[now].offload:
            continue
        here = problem.choices[pn.rep][now]
        for j in device_twins(strategies, now):
            if rule is not None and not rule(problem, pn, strategies[j]):
                continue
            there = problem.choices[pn.rep][j]
            extra = sum(there.memory.values()) - sum(here.memory.values())
            saved = here.time - there.time
            if saved > 0 and extra > 0:
                moves.append((saved / extra, saved, extra, pn.index, j))
    if not moves:
        return best
    choice = Assignment(best.choice, best.choice.modes)
    taken, used = set(), 0.0
    for _, saved, extra, index, j in sorted(moves, key=lambda m: (-m[0], m[3], m[4])):
        if index in taken or used + extra > slack:
            continue
        choice[index] = j
        taken.add(index)
        used += extra
    if not taken:
        return best
    log.info("%d offloaded parameters taken back to the device (%s of the budget's %s left)", len(taken),
             format_bytes(used), format_bytes(slack))
    return dataclasses.replace(best, choice=choice, memory=best.memory + used)
