"""Inputs checked at the door of every forward, so a bad batch fails with its name on it.

- Shape and dtype of every tensor input against the example the model was compiled with
  (the local shard's shape with local_inputs=True; a pipelined plan's whole batch).
- Token ids read by an embedding lie in [0, rows): one device raises IndexError for an id
  out of range; a vocabulary-split embedding would silently read zeros for it.
- During the first CHECKED_CALLS forwards, the ranks compare what they were given (one
  small all-gather): without local_inputs every rank must pass the same global batch
  (the DDP habit of one batch per rank, e.g. from a DistributedSampler, is caught and
  pointed to local_inputs=True); with it, every rank's shard must have the same shape.
  The comparison runs before any collective of the step, so every rank raises the same
  error instead of one rank failing and its peers hanging in a collective.
- After those calls, every SAMPLE_EVERY-th call is compared again, more cheaply (inputs
  that diverge later, e.g. a per-rank seeded reshuffle at the next epoch, would otherwise
  split replicas silently): each rank hashes its inputs into two float64 slots (the hash
  and its negative; per piece with local_inputs) that ride in the all-reduce (MAX) train_step
  already makes for its NaN check (runtime/checks/faults.check_step), so a sampled step costs the
  hash of its batch and no collective more where that check makes one; where it makes
  none (data parallelism, check_finite=False) and in forward, a sampled call costs one
  small all-reduce.  Only when the slots disagree do the ranks gather their hashes
  (all_gather_object) to name who differs.  gpt-tiny, 4 gloo ranks: see InputCheck.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.trace.paths import module_path

CHECKED_CALLS = 3
SAMPLE_EVERY = 10   # after the first calls, every this many-th is compared (InputCheck.sample_every)
_PASS_ON = {"aten.view.default", "aten.reshape.default", "aten.unsqueeze.default", "aten.expand.default",
            "aten.clone.default", "aten.contiguous.default", "aten._to_copy.default", "aten.to.dtype",
            "aten.alias.default", "aten.flatten.using_ints", "aten._unsafe_view.default"}


class InputError(ValueError):
    """An input does not fit the compiled model; the message names it and says what to pass."""


class _ShardArgs(tuple):
    """ShardedInputs.args: a tuple made by cm.shard_inputs, so that train_step knows it."""


class _ShardKwargs(dict):
    """ShardedInputs.kwargs: a dict made by cm.shard_inputs, so that train_step knows it."""


class ShardedInputs(NamedTuple):
    """This rank's shards of a global batch, as `cm.shard_inputs(*batch, **kw)` returns them:
    the positional inputs and the keyword inputs.  It unpacks as the pair it is,

        args, kwargs = cm.shard_inputs(*batch)
        cm.train_step(*args, **kwargs)

    and train_step and forward also take it whole, `cm.train_step(cm.shard_inputs(*batch))`,
    or star-unpacked, `cm.train_step(*cm.shard_inputs(*batch))` (then they receive exactly
    the two halves, of types only shard_inputs makes, so no model input is mistaken for them)."""

    args: tuple
    kwargs: dict

    @classmethod
    def of(cls, args, kwargs) -> "ShardedInputs":
        return cls(_ShardArgs(args), _ShardKwargs(kwargs))


_USE = "args, kwargs = cm.shard_inputs(...); cm.train_step(*args, **kwargs)"


def unpack_sharded(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of a call to train_step or forward, with the ShardedInputs of
    cm.shard_inputs passed whole or star-unpacked opened into what it holds; any other mix
    of a ShardedInputs (or one of its halves) with other inputs raises InputError."""
    if len(args) == 1 and not kwargs and isinstance(args[0], ShardedInputs):
        return tuple(args[0].args), dict(args[0].kwargs)
    if len(args) == 2 and not kwargs and type(args[0]) is _ShardArgs and type(args[1]) is _ShardKwargs:
        return tuple(args[0]), dict(args[1])
    for where, value in [*((f"positional input {k}", a) for k, a in enumerate(args)),
                         *((f"keyword input {name!r}", v) for name, v in kwargs.items())]:
        if isinstance(value, (ShardedInputs, _ShardArgs, _ShardKwargs)):
            what = ("what cm.shard_inputs returned" if isinstance(value, ShardedInputs) else
                    f"the {'args' if isinstance(value, _ShardArgs) else 'kwargs'} of what cm.shard_inputs returned")
            raise InputError(f"{where} is {what}, the pair (args, kwargs) of this rank's shards; train_step and "
                             f"forward take it only as their one input, whole or star-unpacked. Call {_USE}")
    return args, kwargs


@dataclass(frozen=True)
class Expected:
    """One user input: its placeholder name, global shape and dtype, and (token ids) the rows
    of the embeddings it indexes, with their modules."""

    name: str
    shape: tuple | None
    dtype: torch.dtype | None
    rows: tuple = ()   # (rows, module path) of each embedding it feeds


def expected_inputs(gm: fx.GraphModule, user_inputs) -> list[Expected]:
    """Read from the traced graph before the passes rewrite it (global shapes)."""
    user_inputs = set(user_inputs)
    feeds: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or str(node.target) != "aten.embedding.default":
            continue
        src = node.args[1]
        while isinstance(src, fx.Node) and src.op == "call_function" and str(src.target) in _PASS_ON:
            src = src.args[0]
        if isinstance(src, fx.Node) and src.op == "placeholder" and src.target in user_inputs:
            feeds.setdefault(src.target, []).append((node.args[0].meta["val"].shape[0], module_path(node)))
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.target in user_inputs:
            val = node.meta.get("val")
            tensor = isinstance(val, torch.Tensor)
            out.append(Expected(node.target, tuple(val.shape) if tensor else None, val.dtype if tensor else None,
                                tuple(feeds.get(node.target, ()))))
    return out


def local_shape(shape: tuple, layout, groups) -> tuple:
    """The shape of this rank's piece of a tensor of `shape` laid out as `layout`."""
    shape = list(shape)
    for axis, p in enumerate(layout or ()):
        if isinstance(p, Shard):
            shape[p.dim] //= groups.size(axis)
    return tuple(shape)


CARRY = 2.0 ** 50   # above every 48-bit hash: one more bit rides in InputCheck.slots


@dataclass(frozen=True)
class SlotsRead:
    """The all-reduced slots of a sampled call: whether some rank carried 1 (the finite
    check's flag), and whether every piece's ranks passed the same inputs (None: hidden by
    the carried bit; compare them whole)."""

    carried: bool
    same_inputs: bool | None


@dataclass(frozen=True)
class InputSample:
    """The hashes of a sampled call's inputs on this rank, until the ranks compare them:
    per input, (shape, dtype, sha1 of the bytes) of a tensor, the repr of anything else."""

    call: int
    entries: tuple


class InputCheck:
    """The checks of one compiled module (see the module docstring).

    compared_calls: the first calls whose inputs the ranks compare whole (compile's
    check_inputs; 0: none).  sample_every: after those, every this many-th call is compared
    by its hashes (0: never).  A sampled call costs the sha1 of its batch (about 50 us for
    gpt-tiny's two 4x16 int64 tensors) and: in train_step where the NaN check all-reduces
    anyway (tensor parallelism, ZeRO-2/3, pipelines, the solver's replicated plans) one
    float64 more in that call, no collective more; where it does not (data parallelism,
    check_finite=False) and in forward, one all-reduce of two float64.  gpt-tiny on 4 gloo
    ranks (2 shared CPU cores, steps of 13-45 ms), median difference of 100 paired steps
    sampled and not: +0.2 to +0.7 ms folded into the NaN check (Megatron x DP within noise),
    +0.8 to +2.1 ms with its own all-reduce (data parallelism); at the default period of 10,
    under 0.1 and 0.2 ms per step, and 20-step medians with and without the check are within
    their noise.  Three float64 or more would cost gloo about 2 ms more per call, hence the
    two slots (InputCheck.slots)."""

    def __init__(self, expected: list[Expected], groups, batch_scale: int = 1, layouts: list | None = None,
                 compared_calls: int = CHECKED_CALLS, sample_every: int = SAMPLE_EVERY):
        """layouts: each input's layout with local_inputs=True (None: global inputs);
        batch_scale: a pipelined plan is traced for one of this many microbatches."""
        self.expected = expected
        self.groups = groups
        self.layouts = layouts
        self.batch_scale = batch_scale
        self.calls = 0
        self.compared_calls = int(compared_calls)   # RunOptions(check_inputs=...): calls whose inputs ranks compare
        self.sample_every = int(sample_every)       # after those, every this many-th call compared by its hashes
        self.pending: InputSample | None = None   # a sampled call's hashes, for the step's reduction
        self._folding = False

    def _shape_of(self, k: int, e: Expected) -> tuple:
        shape = e.shape
        if self.layouts is not None and self.layouts[k] is not None:
            shape = local_shape(shape, self.layouts[k], self.groups)
        if self.batch_scale > 1 and shape:
            shape = (shape[0] * self.batch_scale,) + tuple(shape[1:])
        return shape

    @contextlib.contextmanager
    def folded(self):
        """Inside (train_step), a sampled call leaves its hashes in `pending` for the step's
        own all-reduce (runtime/checks/faults.check_step) instead of reducing them at the door."""
        self._folding = True
        try:
            yield
        finally:
            self._folding = False

    def take_pending(self) -> InputSample | None:
        """The hashes of this step's sampled call, if it was one (and forget them)."""
        sample, self.pending = self.pending, None
        return sample

    def __call__(self, values: list) -> None:
        """values: the user inputs in placeholder order."""
        self.calls += 1
        self.pending = None   # (a step that raised before its reduction)
        if self.calls <= self.compared_calls:
            self._compare_ranks(self._entries(values), self.calls)
        elif self.sample_every and self.calls % self.sample_every == 0:
            sample = InputSample(self.calls, self._entries(values))
            if self._folding:
                self.pending = sample
            else:   # (forward alone: its own small all-reduce, before any collective of the call)
                slots = self.slots(sample, torch.device(self.groups.mesh.device_type))
                dist.all_reduce(slots, op=dist.ReduceOp.MAX)
                if not self.read(slots).same_inputs:
                    self.compare(sample)
        for k, (e, v) in enumerate(zip(self.expected, values)):
            if e.shape is None or not isinstance(v, torch.Tensor):
                continue
            want = self._shape_of(k, e)
            if tuple(v.shape) != want or v.dtype != e.dtype:
                where = " (this rank's shard: local_inputs=True)" if self.layouts is not None else ""
                raise InputError(f"input {e.name!r} has shape {tuple(v.shape)} {v.dtype}; the model was compiled "
                                 f"for {want} {e.dtype}{where}. Pass inputs of the compiled shape, or compile "
                                 f"again with example inputs of the new shape")
            for rows, module in e.rows:
                if v.numel() and (int(v.min()) < 0 or int(v.max()) >= rows):
                    bad = int(v.min()) if int(v.min()) < 0 else int(v.max())
                    raise IndexError(f"index out of range in self: input {e.name!r} holds id {bad}, outside the "
                                     f"{rows} rows of the embedding in {module or 'the model'!r}")

    @staticmethod
    def _entries(values: list) -> tuple:
        out = []
        for v in values:
            if isinstance(v, torch.Tensor):
                data = v.detach().contiguous().cpu()
                digest = hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
                out.append((tuple(v.shape), str(v.dtype), digest))
            else:
                out.append(repr(v))
        return tuple(out)

    def _groups(self) -> dict:
        """split mesh axes -> the inputs laid out with them: one group, () -> every input,
        without local_inputs; with it, one per layout (ranks that hold the same piece of one
        input of a group hold the same piece of all of them)."""
        out: dict = {}
        for k in range(len(self.expected)):
            layout = self.layouts[k] if self.layouts is not None else None
            out.setdefault(tuple(a for a, p in enumerate(layout or ()) if isinstance(p, Shard)), []).append(k)
        return out

    def slots(self, sample: InputSample, device, carry: torch.Tensor | None = None) -> torch.Tensor:
        """float64 [2 * pieces, summed over the groups of inputs]: per group and piece, the
        hash h of this rank's inputs of the group (48 bits, exact in float64) and -h where
        this rank holds that piece, -inf elsewhere.  All-reduced with MAX, a piece's two slots
        are max(h) and -min(h) over its ranks.  `carry` (float64 [1], 0 or 1: the finite
        check's flag) rides along as CARRY added to this rank's -h slot of the first group,
        so that the reduction stays two elements without local_inputs (on 4 gloo ranks an
        all-reduce of 1 or 2 elements costs about 3 ms inside a step, of 3 or more about 5)."""
        out, own = [], None
        for split, inputs in self._groups().items():
            count, mine = 1, 0
            for a in split:
                count, mine = count * self.groups.size(a), mine * self.groups.size(a) + self.groups.coordinate(a)
            h = float(int(hashlib.sha1(repr([sample.entries[k] for k in inputs]).encode()).hexdigest()[:12], 16))
            own = len(out) + 2 * mine + 1 if own is None else own
            part = [-math.inf] * (2 * count)
            part[2 * mine], part[2 * mine + 1] = h, -h
            out += part
        slots = torch.tensor(out, dtype=torch.float64, device=device)
        if carry is not None:
            slots[own: own + 1] += carry.to(slots) * CARRY
        return slots

    def read(self, reduced: torch.Tensor) -> "SlotsRead":
        """What the all-reduced `slots` say, the same on every rank."""
        pairs = reduced.detach().cpu().view(-1, 2)
        first = 1   # pieces of the first group, whose -h slots carry the bit
        for a in next(iter(self._groups())):
            first *= self.groups.size(a)
        if bool((pairs[:first, 1] > 0).any()):   # some rank carried 1: its -h slot no longer says min(h)
            return SlotsRead(carried=True, same_inputs=None)
        return SlotsRead(carried=False, same_inputs=bool((pairs[:, 0] == -pairs[:, 1]).all()))

    def compare(self, sample: InputSample) -> None:
        """Every rank's inputs of a sampled call gathered whole (all_gather_object, every rank
        calls it): the InputError naming the call, the input and the ranks that differ, raised
        on every rank, or nothing when they agree."""
        self._compare_ranks(sample.entries, sample.call)

    def _compare_ranks(self, mine: tuple, call: int) -> None:
        coord = [self.groups.coordinate(a) for a in range(self.groups.ndim)]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (coord, mine))
        later = ""
        if call > self.compared_calls:
            since = (f"The ranks passed the same inputs for the first {self.compared_calls} calls, so their data "
                     f"diverged since" if self.compared_calls else "Data that diverges between calls")
            later = (f" {since}: a sampler or shuffle seeded per rank does this (e.g. reshuffled at a new epoch "
                     f"with a rank-dependent seed).")
        for k, e in enumerate(self.expected):
            layout = self.layouts[k] if self.layouts is not None else None
            split = [a for a, p in enumerate(layout or ()) if isinstance(p, Shard)]
            first: dict = {}   # the piece a rank holds -> (rank, what rank 0 of that piece passed)
            odd = []           # (first rank of the piece, rank, its entry) that differ
            for rank, (c, theirs) in enumerate(every):
                piece = tuple(c[a] for a in split)
                seen = first.setdefault(piece, (rank, theirs[k]))
                if seen[1] != theirs[k]:
                    odd.append((seen[0], rank, theirs[k]))
                elif _shape(theirs[k]) != _shape(every[0][1][k]):   # (shards of one shape on every rank)
                    odd.append((0, rank, theirs[k]))
            if not odd:
                continue
            base, rank, b = odd[0]
            more = [r for _, r, _ in odd[1:]]
            also = f"; so did rank(s) {', '.join(map(str, more))}" if more else ""
            if self.layouts is None:
                raise InputError(
                    f"rank {rank} passed a different input {e.name!r} than rank 0 on call {call} ({_brief(b)} vs "
                    f"{_brief(every[0][1][k])}){also}.{later} autopar takes the same global batch on every rank; "
                    f"to give each rank its own part (the DistributedDataParallel habit), compile with "
                    f"run=autopar.RunOptions(local_inputs=True) and pass the rank's piece laid out as "
                    f"cm.input_layouts says (cm.shard_inputs cuts it from a global batch)")
            raise InputError(
                f"ranks {base} and {rank} hold the same piece of input {e.name!r} (layout {_layout(layout)}: split "
                f"only over mesh axes {split}) but passed {_brief(every[base][1][k])} and {_brief(b)} on call "
                f"{call}{also}.{later} Give the ranks that share a piece the same data, e.g. "
                f"DistributedSampler(num_replicas=<ranks along the split axes>, rank=<coordinate there>)")


def _brief(entry) -> str:
    if isinstance(entry, tuple):
        shape, dtype, digest = entry
        return f"{shape} {dtype.replace('torch.', '')}, contents {digest[:8]}"
    return entry


def _shape(entry):
    return entry[:2] if isinstance(entry, tuple) else entry


def _layout(layout) -> str:
    return "(" + ", ".join(f"S({p.dim})" if isinstance(p, Shard) else "R" for p in layout or ()) + ")"
