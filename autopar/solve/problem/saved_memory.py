"""What a problem's ops keep for backward (SavedMemory): every holding of every op, the
storages several ops share, and their bytes per device under a strategy or a whole choice."""
from __future__ import annotations

import math

import numpy as np
from torch.distributed.tensor import Replicate

from autopar import placements as P
from autopar.cost.redistribution import plan_redistribute
from autopar.cost.saved import SCALAR, Saved, is_alias, saved_by
from autopar.mesh import Mesh
from autopar.ops import Strategy, op_arg
from autopar.ops.attention_rule import private_holdings
from autopar.ops.experts_rule import kept_tokens_factor
from autopar.ops.grid_rule import is_grid, is_split_norm
from autopar.ops.rules import VIEWS
from autopar.solve.problem.graph import PNode
from autopar.solve.problem.partitioned import partitioned_holdings
from autopar.solve.problem.pricing import Remembered


class SavedMemory:
    """holdings[n]: (key, kind, index, global bytes) of every tensor op n keeps for backward
    (autopar/cost/saved.py); key names the storage (None: its own), and savers[key] counts
    its holders in kept_holdings (each counted as `holders(owner, holder)`:
    StandIns.holders), so a storage several ops keep is charged once.
    kept_holdings: what a step keeps when nothing is recomputed: what the derivatives read
    under eager; under Inductor, less what the compiled graphs' partitioner runs again
    (partitioned.py)."""

    def __init__(self, nodes: list, mesh: Mesh, backend: str, block: dict, remembered: Remembered,
                 holders=lambda owner, holder: 1):
        self.nodes, self.mesh, self.remembered = nodes, mesh, remembered
        gpu = not mesh.device.name.lower().startswith("cpu")
        self.holdings: dict[int, list] = {}
        for pn in nodes:
            if pn.kind == "op" and pn.requires_grad and pn.op not in VIEWS:
                self.holdings[pn.index] = self._held_by(pn, gpu)
        self.kept_holdings = (partitioned_holdings(nodes, self.holdings, block, self.storage_root)
                              if backend == "inductor" else self.holdings)
        self.savers: dict = {}
        for n, held in self.kept_holdings.items():
            for key, *_ in held:
                if key is not None:
                    self.savers[key] = self.savers.get(key, 0) + holders(key[0], n)

    def _held_by(self, pn: PNode, gpu: bool) -> list:
        """The holdings of op pn (see the class)."""
        items = saved_by(pn.node, [self.nodes[src].requires_grad for src, _ in pn.inputs], gpu)
        if items is None:  # cannot run on meta: its activation operands, as read
            items = [Saved("in", k) for k in range(len(pn.inputs))]
        held = []
        for it in items:
            if it.kind == "in":
                if it.index >= len(pn.inputs):
                    continue
                key = self.storage_root(*pn.inputs[it.index])
                if self.nodes[key[0]].kind != "op":
                    # a parameter, buffer or input: not an activation, unless the plan
                    # reads it through a move whose copy is then kept (kept_bytes)
                    held.append((None, "leaf", it.index, 0.0))
                    continue
                root = self.nodes[key[0]]
                held.append((key, "in", it.index, math.prod(root.out_shapes[key[1]]) *
                             root.out_dtypes[key[1]].itemsize))
            elif it.kind == "out":
                if it.index >= len(pn.out_shapes):
                    continue
                held.append(((pn.index, it.index), "out", it.index,
                             math.prod(pn.out_shapes[it.index]) * pn.out_dtypes[it.index].itemsize))
            else:
                held.append((None, "new", it.index, it.nbytes))
        if pn.op == "aten.cross_entropy_loss" and op_arg(pn.node, 3, "reduction", 1) == 1:
            # split by rows or classes, the runtime's mean divides by the count of the
            # targets it counts (passes/local_ops.local_cross_entropy), which it keeps
            held.append((None, "count", 0, 8.0))
        return held

    def storage_root(self, src: int, out: int) -> tuple:
        """(node, output) whose storage tensor src[out] lives in: views followed back."""
        while True:
            pn = self.nodes[src]
            if pn.kind != "op" or not pn.inputs or not is_alias(pn.node):
                return src, out
            src, out = pn.inputs[0]

    def held_bytes(self, pn: PNode, s: Strategy, item) -> float:
        """Local bytes of one holding of op pn under strategy s (its whole storage's share
        in the layout pn reads or makes it)."""
        shape_of = self.mesh.shape
        _, kind, index, nbytes = item
        if kind == "leaf":
            return 0.0
        if kind.startswith("own "):   # kept by an op run whole when it communicates inside
            if not s.comm:            # (recompute/modes.ModeCosts, selective)
                return 0.0
            kind = kind[4:]
        if kind == "in":
            src, o = pn.inputs[index]
            shape = self.nodes[src].out_shapes[o]
            local = nbytes * P.local_numel(shape, s.inputs[index], shape_of) / max(1, math.prod(shape))
            if pn.op == "autopar.experts" and index == 0:   # (x: the routed rows under expert parallelism)
                return local * kept_tokens_factor(s, self.nodes[pn.inputs[1][0]].out_shapes[pn.inputs[1][1]][-1])
            return local
        if kind == "count":   # (a local cross entropy's count, _held_by)
            split = any(not isinstance(p, Replicate) for lay in (*s.inputs, *s.outputs) for p in lay)
            return nbytes if split else 0.0
        if kind == "new" and index == SCALAR:
            return nbytes
        if kind in ("out", "result"):   # (result: the op's output as it returns it)
            shape = pn.out_shapes[index]
            return nbytes * P.local_numel(shape, s.outputs[index], shape_of) / max(1, math.prod(shape))
        # a new tensor: split as the op's largest operand is
        shapes = [(self.nodes[src].out_shapes[o], p) for (src, o), p in zip(pn.inputs, s.inputs)]
        shapes += list(zip(pn.out_shapes, s.outputs))
        shape, p = max(shapes, key=lambda sp: math.prod(sp[0]) if sp[0] else 1)
        return nbytes * P.local_numel(shape, p, shape_of) / max(1, math.prod(shape) if shape else 1)

    def held_array(self, pn: PNode, item) -> np.ndarray:
        """held_bytes of one holding under each of pn's representative's strategies, kept
        per (representative, holding's kind, index and bytes): identical layers hold alike."""
        return self.remembered("held", (pn.rep, *item[1:]), lambda: np.array(
            [self.held_bytes(pn, s, item) for s in self.nodes[pn.rep].strategies]))

    def saved_entries(self) -> list:
        """(node index, holding) of everything the ops keep when nothing is recomputed."""
        return [(n, item) for n, held in self.kept_holdings.items() for item in held]

    def kept_bytes(self, choice: dict, entries) -> float:
        """The activation bytes per device a solved choice keeps, storage by storage as the
        plan lays them out (the ILP's per-node shares are its linear estimate): a tensor
        read in its producer's layout is the producer's storage (aliases followed), read
        through a move it is the move's new tensor of the reader's local size (a slice of
        the leading dim alone stays a view of its source; a slice of a collective's buffer
        is copied out by the runtime), and a storage several ops keep counts once."""
        storages: dict = {}
        total = 0.0
        for n, item in entries:
            pn = self.nodes[n]
            s = self.nodes[pn.rep].strategies[choice[n]]
            key, kind, index, _ = item
            if kind.startswith("own ") and not s.comm:
                continue
            base = kind.removeprefix("own ")
            if s.comm and base in ("in", "out") and self._private(pn, s, base, index):
                # an op that communicates inside (Ulysses, the causal ring, expert all-to-alls)
                # keeps what its inner kernel read and made: buffers of its own
                storages[("own", n, base, index)] = self.held_bytes(pn, s, item)
                continue
            if base == "out":
                key = (n, index)
            kind = base
            if kind in ("in", "leaf"):
                src, o = pn.inputs[index]
                found = self._storage_as_read(src, o, tuple(s.inputs[index]), choice)
                if found is not None:
                    storages[found[0]] = found[1]
            elif key is None:
                total += self.held_bytes(pn, s, item)
            else:
                storages[key] = self.held_bytes(pn, s, item)
        return total + sum(storages.values())

    @staticmethod
    def _private(pn: PNode, s: Strategy, kind: str, index: int) -> bool:
        """Whether op pn, communicating inside under s, keeps ("in"/"out", index) in a
        buffer of its own (ops/attention_rule.private_holdings)."""
        if is_grid(s) or is_split_norm(s):
            return False   # (they keep their operands' local blocks, as given)
        causal = pn.op == "autopar.window_attention" or bool(op_arg(pn.node, 5, "is_causal", False))
        own = private_holdings(s, causal)
        return own is None or (kind, index) in own

    def _storage_as_read(self, src: int, out: int, layout: tuple, choice: dict):
        """(storage key, local bytes) of tensor src[out] as a reader gets it in `layout`;
        None for a parameter, buffer or input's own storage."""
        a = self.nodes[src]
        if a.kind not in ("op", "param", "input"):
            return None
        made = tuple(self.nodes[a.rep].strategies[choice[src]].outputs[out])
        shape, item = a.out_shapes[out], a.out_dtypes[out].itemsize
        steps = plan_redistribute(made, layout, self.mesh.shape) if made != layout else ()
        if any(st.kind != "chunk" or st.dim != 0 for st in steps):   # (a slice of dim 0 is a view)
            moves = [st for st in steps if st.is_collective]
            if a.kind == "param" and moves and all(st.kind == "all_gather" for st in moves):
                return None   # a gathered weight is dropped after forward and gathered again
            return ("moved", src, out, layout), P.local_numel(shape, layout, self.mesh.shape) * item
        if a.kind != "op":
            return None
        if a.inputs and is_alias(a.node):
            up, o = a.inputs[0]
            sa = self.nodes[a.rep].strategies[choice[src]]
            return self._storage_as_read(up, o, tuple(sa.inputs[0]), choice)
        return (src, out), P.local_numel(shape, made, self.mesh.shape) * item
