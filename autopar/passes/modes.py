"""modes: one compiled graph that runs in train and in eval mode, as the plain model does.

The plan is made on the model's training graph.  In ATen training IR a module's eval
behaviour usually differs from its training behaviour only in constants: dropout's
`train` flag, batch norm's `training` flag, attention's `dropout_p` (`p if self.training
else 0.0`), plus in-place updates of buffers that only training runs (batch norm's
`num_batches_tracked += 1`).  `mode_switch` walks the training graph and the eval graph of
the same model side by side and records exactly those differences; `ModeSwitch.apply`
then turns any graph rewritten from the training graph (collectives, local shapes, pipeline
stages: the original nodes keep their names) into the eval one and back.  A pass that
replaces a node's ATen target by a wrapper (autopar/runtime/regions/rng.py) keeps the op in
node.meta["aten_target"], whose schema names the arguments.

Where the two graphs differ in anything else (a forward that adds or removes ops under
`if self.training`), the switch records why and `apply(..., training=False)` raises
ModeError naming the first differing node and its module: no silent fallback to the
training behaviour.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from autopar.trace.paths import module_path


class ModeError(RuntimeError):
    """The compiled model cannot switch to the asked mode; the message says why and what to do."""


def _skip_update(*args, **kwargs):
    """Stands for a buffer update that only training runs (eval mode leaves the buffer)."""
    return args[0]


@dataclass(frozen=True)
class NodeSwitch:
    """One node's differences between the modes.  args: (argument name, or position for
    calls without a schema; training value; eval value) of each constant that differs; skip: in eval mode the node
    (a buffer update) does nothing."""

    name: str
    args: tuple = ()
    skip: bool = False


@dataclass
class ModeSwitch:
    """The differences between a model's training and eval graphs (see the module docstring).
    reason: why no eval form could be derived ('' when it could).

    derive: where the eval graph is not traced yet, the function that traces it and returns
    the switch (autopar/runtime/build.py): most jobs never leave training mode, and an
    export per rank is the largest part of compiling a small model, so the eval graph is
    traced on the first switch to eval, not at compile.  Until then the graph is in its
    training form, which is what a switch to training asks for."""

    switches: dict = field(default_factory=dict)   # node name -> NodeSwitch
    reason: str = ""
    derive: Callable[[], "ModeSwitch"] | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        if self.derive is not None:
            return "eval mode traced on the first eval()"
        if self.reason:
            return f"no eval mode: {self.reason}"
        return f"{len(self.switches)} nodes switch between train and eval"

    def derived(self) -> "ModeSwitch":
        """This switch with its eval graph traced (at most once)."""
        if self.derive is not None:
            derive, self.derive = self.derive, None
            found = derive()
            self.switches, self.reason = found.switches, found.reason
        return self

    def apply(self, gm: fx.GraphModule, training: bool) -> None:
        """Put `gm` (rewritten from the training graph) into `training` or eval mode."""
        if training and self.derive is not None:
            return  # never switched to eval: the graph is in its training form
        self.derived()
        if not training and self.reason:
            raise ModeError(f"cannot run the compiled model in eval mode: {self.reason}. autopar switches "
                            f"modes by flags only (dropout, batch norm, attention dropout); evaluate with "
                            f"the plain model, or make the forward's eval-only code a flag of an op")
        changed = False
        for node in gm.graph.nodes:
            sw = self.switches.get(node.name)
            if sw is None or node.op != "call_function":
                continue
            if sw.skip:
                original = node.meta.setdefault("aten_target", node.target)
                node.target = original if training else _skip_update
            args, kwargs = list(node.args), dict(node.kwargs)
            schema = getattr(node.meta.get("aten_target", node.target), "_schema", None)
            names = [a.name for a in schema.arguments] if schema is not None else []
            for where, train_value, eval_value in sw.args:
                value = train_value if training else eval_value
                if isinstance(where, str) and where in names and names.index(where) < len(args):
                    where = names.index(where)
                if isinstance(where, int):
                    args[where] = value
                else:
                    kwargs[where] = value
            node.args, node.kwargs = tuple(args), kwargs
            changed = True
        if changed:
            gm.recompile()


def _has_node(value) -> bool:
    found = []
    fx.node.map_arg(value, found.append)
    return bool(found)


def _by_name(node: fx.Node) -> dict | None:
    """An ATen call's arguments by schema name, defaults filled in (so `f(x, p=0.0)` and
    `f(x)` compare equal); None for calls without a schema."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    out = {}
    for k, arg in enumerate(schema.arguments):
        if k < len(node.args):
            out[arg.name] = node.args[k]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _differing_constants(a: fx.Node, b: fx.Node, rename: dict, alias: dict):
    """(argument name, a's value, b's value) of every argument in which the calls a and b
    differ, when they are the same op reading corresponding nodes and differ only in
    constants; None otherwise."""
    if a.op != b.op or a.target != b.target:
        return None
    if a.op == "call_function" and (x := _by_name(a)) is not None:
        y = _by_name(b)
    else:
        if len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs):
            return None
        x = {**dict(enumerate(a.args)), **a.kwargs}
        y = {**dict(enumerate(b.args)), **b.kwargs}
    if set(x) != set(y):
        return None
    out = []
    for where in x:
        u, v = x[where], y[where]
        if _has_node(u) or _has_node(v):
            if fx.node.map_arg(u, lambda n: rename.get(n.name)) != fx.node.map_arg(v, lambda n: alias.get(n.name, n.name)):
                return None
        elif u != v:
            out.append((where, u, v))
    return out


def _is_buffer_update(node: fx.Node, buffers: set) -> bool:
    """An in-place op on a buffer whose result nobody reads (e.g. num_batches_tracked += 1)."""
    if node.op != "call_function" or node.users or not node.args:
        return False
    schema = getattr(node.target, "_schema", None)
    first = node.args[0]
    return (schema is not None and schema.name.endswith("_") and isinstance(first, fx.Node)
            and first.op == "placeholder" and first.target in buffers)


_IDENTITY = {"aten.contiguous.default", "aten.alias.default", "aten.view.default", "aten.reshape.default",
             "aten._unsafe_view.default"}


def _identity_of(node: fx.Node):
    """The input a node passes on unchanged in value (a contiguous() the tracer kept in one
    mode because the memory layout differed, a view to the same shape), else None."""
    if node.op != "call_function" or str(node.target) not in _IDENTITY or not node.args:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    a, b = src.meta.get("val"), node.meta.get("val")
    if a is None or b is None or tuple(a.shape) != tuple(b.shape):
        return None
    return src


def mode_switch(train: fx.GraphModule, eval_: fx.GraphModule, buffers) -> ModeSwitch:
    """The ModeSwitch from a model's training graph to its eval graph (both traced by
    autopar.trace.export from the same model and inputs).  buffers: placeholder names of buffers."""
    buffers = set(buffers)
    t_nodes = list(train.graph.nodes)
    e_nodes = list(eval_.graph.nodes)
    rename: dict = {}   # training node name -> eval node name
    alias: dict = {}    # eval node that only passes on its input -> that input
    out = ModeSwitch()
    i = j = 0
    while i < len(t_nodes) and j < len(e_nodes):
        a, b = t_nodes[i], e_nodes[j]
        diff = _differing_constants(a, b, rename, alias)
        if diff is not None:
            rename[a.name] = b.name
            if diff:
                out.switches[a.name] = NodeSwitch(a.name, tuple(diff))
            i += 1
            j += 1
        elif _is_buffer_update(a, buffers):
            out.switches[a.name] = NodeSwitch(a.name, skip=True)
            i += 1
        elif (src := _identity_of(a)) is not None and src.name in rename:
            rename[a.name] = rename[src.name]   # runs in eval mode too, harmlessly
            i += 1
        elif (src := _identity_of(b)) is not None:
            alias[b.name] = alias.get(src.name, src.name)
            j += 1
        else:
            return ModeSwitch(reason=f"the eval graph differs from the training graph at node {a.name} "
                                     f"({a.target}) in module {module_path(a) or 'the model'!r}, which runs "
                                     f"{b.name} ({b.target}) in eval mode")
    rest = [n for n in t_nodes[i:] if not _is_buffer_update(n, buffers)]
    rest_eval = [n for n in e_nodes[j:] if _identity_of(n) is None]
    if rest or rest_eval:
        extra = rest[0] if rest else rest_eval[0]
        return ModeSwitch(reason=f"one graph has node {extra.name} ({extra.target}) in module "
                                 f"{module_path(extra) or 'the model'!r} and the other does not")
    for n in t_nodes[i:]:
        out.switches[n.name] = NodeSwitch(n.name, skip=True)
    return out
