"""From a choice of strategies to the plan's facts: per-node records, the collectives the
choice implies, and the predicted step time (overlap counted) and memory per device."""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from autopar.cost import prices as C
from autopar import placements as P
from autopar.report.plan import Collective, NodeChoice, Prediction
from autopar.solve.problem.gradient_paths import bucket_kinds
from autopar.solve.problem.problem import Problem
from autopar.report.records import RECOMPUTING
from autopar.solve.recompute.modes import beyond_linear, mode_costs
from autopar.solve.recompute.tiers import tier_bytes

CATEGORIES = ("params", "grads", "optimizer", "activations", "working")


@dataclass(frozen=True)
class Assembled:
    """A choice's facts.  nodes: node index -> NodeChoice (gradient sums left out);
    collectives: every collective the plan runs, in node order; predicted: the step's
    time and memory; grad_sums: "source:output" -> the layout its gradient sum takes;
    folded: node index -> seconds of the tensor-parallel collectives it owns that run
    hidden beside GEMMs (Prediction.linear_hidden_s, per owner: what the pipeline's stage
    costs take off where the runtime folds them)."""

    nodes: dict
    collectives: tuple
    predicted: Prediction
    grad_sums: dict
    folded: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return f"{len(self.nodes)} nodes, {len(self.collectives)} collectives; {self.predicted}"


def predict(problem: Problem, choice: dict) -> Prediction:
    """assemble(problem, choice).predicted."""
    return assemble(problem, choice).predicted


def assemble(problem: Problem, choice: dict) -> Assembled:
    """Per-node choices, the collectives they imply and the predicted step time and memory."""
    tally = _Tally(problem, choice)
    nodes: dict[int, NodeChoice] = {}
    grad_sums = {}
    for pn in problem.nodes:
        s = problem.nodes[pn.rep].strategies[choice[pn.index]]
        c = problem.choices[pn.rep][choice[pn.index]]
        tally.node(pn, s, c)
        edge_comm = tally.edges(pn)
        if pn.kind == "gradsum":
            src, out = pn.source
            grad_sums[f"{problem.nodes[src].name}:{out}"] = s.outputs[0]
            continue
        nodes[pn.index] = NodeChoice(pn.name, pn.op, pn.module if pn.kind != "param" else pn.param_name,
                                     s.name, tuple(s.split), tuple(s.inputs), tuple(s.outputs), tuple(s.grads),
                                     c.compute, sum(c.comm) + edge_comm, sum(c.memory.values()), tuple(s.reduced))
    for i, seconds in tally.copied.items():
        if i in nodes:
            nodes[i] = dataclasses.replace(nodes[i], compute_s=nodes[i].compute_s + seconds)
    if not problem.steps.seen_alike(problem.edges, choice):   # the ranks compare their finite checks: one scalar all-reduce,
        check = tally.finite_check()      # the output node's time
        out = next((i for i, n in nodes.items() if problem.nodes[i].kind == "output"), None)
        if out is not None:
            nodes[out] = dataclasses.replace(nodes[out], comm_s=nodes[out].comm_s + check)
    predicted = tally.prediction()
    return Assembled(nodes, tuple(tally.collectives), predicted, grad_sums, dict(tally.folded_at))


class _Tally:
    """What assemble adds up over the nodes of one choice, in node order: compute,
    communication per mesh axis, memory per category, the collectives, and per op what the
    two-stream overlap models need (hidden_gradient_seconds, hidden_prefetch_seconds)."""

    def __init__(self, problem: Problem, choice: dict):
        self.problem, self.choice = problem, choice
        self.compute = 0.0
        self.op_compute = 0.0   # the ops' forward and backward, without the optimizer step
        self.host = 0.0         # the host's seconds issuing them (DeviceSpec.host_op)
        self.comm = [0.0] * problem.mesh.ndim
        self.memory = dict.fromkeys(CATEGORIES, 0.0)
        self.collectives = []
        # per op, what the two-stream overlap models need, communication by link (`link`)
        self.backward = {}   # op index -> (its backward compute, {link: its backward's synchronous communication})
        self.forward = {}    # op index -> (its forward compute, {link: its forward's synchronous communication})
        self.gathers = {}    # op index -> {link: seconds of the prefetchable weight gathers it waits for}
        self.bucketed = {}   # op index -> {link: seconds of gradient buckets that become ready when its backward ends}
        self.links = tuple(link(problem.mesh, a) for a in range(problem.mesh.ndim))
        self.once = {}       # op index -> those of its buckets that run once per step (Pricing.accumulation > 1)
        self.folded = []     # (axis, link, seconds, owner op, linears, forward): collectives beside GEMMs
        self.folded_at = {}  # owner op -> seconds of them hidden (_fold_linears)
        self.pieces_extra = {}   # row-parallel linear -> the share of its forward its pieces add
        self.first_reader = _first_readers(problem)
        self.copied = {}     # node index -> seconds of the bucket copies its tensor's moves make (EdgePrices.copies)
        self.edges_into: dict = {}
        for e in problem.edges:  # a data edge belongs to its consumer, a gradient edge to its tensor's producer
            owner = e.b if e.kind == "data" else (e.b if e.kind == "grad_out" else problem.nodes[e.b].source[0])
            self.edges_into.setdefault(owner, []).append(e)

    def node(self, pn, s, c) -> None:
        """A node's own compute, communication and memory under strategy s (costs c)."""
        names = self.problem.mesh.axis_names
        self.compute += c.compute
        if pn.kind == "op":
            self.op_compute += c.compute
            if self.problem.node_prices.launches(pn):
                self.host += self.problem.mesh.device.host_op * (2 if pn.requires_grad else 1)
            fwd = c.forward_s - sum(c.comm) / 2
            half = {}
            for a, t in enumerate(c.comm):   # half of a strategy's own collectives in each direction
                if t:
                    _add(half, self.links[a], t / 2)
            self.backward[pn.index] = (c.compute - fwd, dict(half))
            self.forward[pn.index] = (fwd, half)
        if pn.kind == "param" and s.zero:  # ZeRO-1/2: updated weights all-gathered after the step
            for st in self.problem.node_prices.zero_gather_steps(pn, s):
                self.comm[st.axis] += st.seconds
                self.collectives.append(Collective("all_gather", (names[st.axis],), st.nbytes, "step",
                                                   pn.param_name, pn.param_name, st.seconds, st.algorithm))
        else:
            for a, t in enumerate(c.comm):
                self.comm[a] += t
            if pn.kind == "op" and any(c.comm):   # a named strategy's own collectives, one per call
                own = self.problem.node_prices.internal_collectives(pn, s)
                times = [C.collective_time(kind, nbytes, axis, self.problem.mesh) for kind, axis, nbytes, _ in own]
                scale = sum(c.comm) / sum(times) if sum(times) else 0.0   # (an experts op's routing factor)
                for (kind, axis, nbytes, phase), t in zip(own, times):
                    self.collectives.append(Collective(kind, (names[axis],), nbytes, phase, pn.name, pn.name, t * scale))
        for k, v in c.memory.items():
            self.memory[k] += v

    def finite_check(self) -> float:
        """The finite check's all-reduce (EdgeSteps.finite_check), after backward, hiding
        nothing; returns its seconds."""
        names, seconds = self.problem.mesh.axis_names, 0.0
        for st in self.problem.steps.finite_check:
            self.comm[st.axis] += st.seconds
            seconds += st.seconds
            self.collectives.append(Collective(st.kind, (names[st.axis],), st.nbytes, "step", "output",
                                               "finite check", st.seconds, st.algorithm))
        return seconds

    def edges(self, pn) -> float:
        """The redistributions of the edges `pn` owns; returns their seconds."""
        problem, choice, names = self.problem, self.choice, self.problem.mesh.axis_names
        edge_comm = 0.0
        for e in self.edges_into.get(pn.index, ()):
            fwd, bwd = problem.steps.of(problem.rep_edge(e), choice[e.a], choice[e.b])
            copies = problem.edge_prices.copies.get(problem.rep_edge(e))
            if copies is not None:
                # the flat buffers' copies around bucketed moves: compute, shown as the
                # parameter's where they run once per step, else as the reader's
                seconds = float(copies[choice[e.a], choice[e.b]])
                once = float(problem.edge_prices.copies_once[problem.rep_edge(e)][choice[e.a], choice[e.b]])
                self.compute += seconds
                at = e.a if e.kind == "data" else pn.index
                at = at if problem.nodes[at].kind == "param" else _upstream_param(problem, at)
                self.copied[at] = self.copied.get(at, 0.0) + once
                self.copied[pn.index] = self.copied.get(pn.index, 0.0) + seconds - once
            src = problem.nodes[e.a] if e.kind == "data" else problem.nodes[e.b]
            param = problem.nodes[e.a] if e.kind == "data" else (pn if pn.kind == "param" else None)
            prefetched = (e.kind == "data" and param is not None and param.kind == "param" and len(fwd) == 1
                          and fwd[0].kind == "all_gather")   # the runtime prefetches exactly these
            folded = self._linear_readers(e)
            rows = self._row_parallel(e)
            for phase, steps in (("forward", fwd), ("backward", bwd)):
                for st in steps:
                    on = self.links[st.axis]
                    if phase == "forward" and pn.index in self.forward:
                        if prefetched:
                            _add(self.gathers.setdefault(pn.index, {}), on, st.seconds)
                        elif rows:
                            self.folded.append((st.axis, on, st.seconds, pn.index, rows, True))
                        else:
                            _add(self.forward[pn.index][1], on, st.seconds)
                    self.comm[st.axis] += st.seconds
                    edge_comm += st.seconds
                    if phase == "backward" and st.bucketed and st.kind != "all_gather":   # a gradient bucket
                        at = pn.index if e.kind == "data" else self.first_reader.get(param.index)
                        _add(self.bucketed.setdefault(at, {}), on, st.seconds)
                        if problem.pricing.accumulation > 1 and st.kind in bucket_kinds(
                                problem.nodes[param.rep].strategies[choice[param.index]]):
                            _add(self.once.setdefault(at, {}), on, st.seconds)
                    elif phase == "backward" and folded:
                        self.folded.append((st.axis, on, st.seconds, pn.index, folded, False))
                    elif phase == "backward" and pn.index in self.backward:
                        _add(self.backward[pn.index][1], on, st.seconds)
                    self.collectives.append(Collective(st.kind, (names[st.axis],), st.nbytes, phase, pn.name,
                                                       src.param_name or src.name, st.seconds, st.algorithm))
        return edge_comm

    def _reduction(self, e, backward: bool):
        """Edge e's forward or backward move's one all-reduce or reduce-scatter (Step), or None."""
        return self.problem.steps.reduction(self.problem.rep_edge(e), self.choice[e.a], self.choice[e.b], backward)

    def _linear_readers(self, e) -> tuple:
        """The linears whose weight gradients the runtime computes while edge e's backward
        collective runs (autopar/passes/fold_linears.py folds exactly these): one
        all-reduce or reduce-scatter into the input gradient of a tensor, not a parameter,
        read only as the input of aten.linear ops; () for any other edge."""
        nodes = self.problem.nodes
        if e.kind not in ("data", "grad_out") or nodes[e.a if e.kind == "data" else e.b].kind == "param" \
                or self._reduction(e, backward=True) is None:
            return ()
        if e.kind == "data":
            readers = [] if (e.a, e.out) in self.problem.gradsum_of else [(e.b, e.operand)]
        else:
            readers = self.problem.readers.get((e.b, e.out), [])
        if readers and all(nodes[r].kind == "op" and nodes[r].op == "aten.linear" and k == 0 for r, k in readers):
            return tuple(r for r, _ in readers)
        return ()

    def _row_parallel(self, e) -> tuple:
        """(the linear,) whose output edge e's forward collective the runtime starts piece by
        piece while the next piece of the GEMM computes (autopar/passes/fold_linears.py
        folds exactly these): one all-reduce or reduce-scatter of the only reader's copy of
        an aten.linear's output that has a dim to cut in pieces (prices.gemm_chunk_dim); ()
        for any other edge."""
        a = self.problem.nodes[e.a]
        if e.kind != "data" or a.kind != "op" or a.op != "aten.linear" \
                or len(self.problem.readers.get((e.a, e.out), ())) != 1:
            return ()
        step = self._reduction(e, backward=False)
        if step is None:
            return ()
        s = self.problem.nodes[a.rep].strategies[self.choice[e.a]]
        local = P.local_shape(a.out_shapes[e.out], s.outputs[e.out], self.problem.mesh.shape)
        if C.gemm_chunk_dim(local, step.kind, step.dim) is None:
            return ()
        self.pieces_extra[e.a] = self.problem.edge_prices.pieces_extra(a, s, local)
        return (e.a,)

    def _fold_linears(self, overlap: bool, kept=frozenset()) -> dict:
        """Each folded collective against the GEMMs the runtime runs beside it: an input
        gradient's against its linears' weight gradients (their backward less the input
        gradient's GEMM, as long as their forward), a row-parallel output's pieces against
        the next piece's forward (all but the last piece's, GEMM_CHUNKS pieces, less what
        the GEMM loses in pieces: EdgePrices.pieces_extra).  The part
        that outlasts them is the owner's synchronous communication; returns what is hidden
        by mesh axis name (nothing where the device is not asynchronous).  kept: the ops
        selective recomputation keeps; the runtime does not fold an input gradient whose
        linears are some kept and some not, nor a kept row-parallel linear
        (passes/fold_linears.fold_linear_gradients): their collectives stay whole."""
        hidden, self.folded_at = {}, {}
        names = self.problem.mesh.axis_names
        for axis, on, seconds, owner, linears, forward in self.folded:
            if forward:   # (less what the GEMM in pieces costs more than whole)
                beside = sum(self.forward[r][0] for r in linears if r in self.forward)
                extra = sum(self.forward[r][0] * self.pieces_extra.get(r, 0.0) for r in linears if r in self.forward)
                h = max(min(seconds, beside) * (C.GEMM_CHUNKS - 1) / C.GEMM_CHUNKS - extra, 0.0)
            else:
                h = min(seconds, sum(max(self.backward[r][0] - self.forward[r][0], 0.0)
                                     for r in linears if r in self.backward))
            held = {r in kept for r in linears}
            unfolded = True in held and (forward or len(held) > 1)
            h = h if overlap and not unfolded else 0.0
            if h:
                hidden[names[axis]] = hidden.get(names[axis], 0.0) + h
                self.folded_at[owner] = self.folded_at.get(owner, 0.0) + h
            sync = (self.forward if forward else self.backward).get(owner)
            if sync is not None and seconds > h:
                _add(sync[1], on, seconds - h)
        return hidden

    def prediction(self) -> Prediction:
        """The step: compute (recomputed forwards included) plus communication less what
        overlaps, and the memory with exact activations and working memory.  On an
        asynchronous device the host issues the ops while earlier ones run, so forward and
        backward take the longer of their kernels and the host's time issuing them
        (DeviceSpec.host_op per op and direction): a small model on a fast GPU is bound by
        its host, the more so where it recomputes (RECOMPUTE_HOST)."""
        problem, choice, mesh = self.problem, self.choice, self.problem.mesh
        compute, memory = self.compute, self.memory
        modes = getattr(choice, "modes", None)
        costs = mode_costs(problem, modes) if modes else None
        host, kernels = self.host, self.op_compute
        if costs is not None:  # recomputed layers: their forward run again, and the host issues it again
            again = costs.seconds(choice)
            compute += again
            kernels += again
            host += mesh.device.host_op * RECOMPUTE_HOST * sum(
                len(members) for path, members in costs.members.items() if costs.modes.get(path) in RECOMPUTING)
        host_bound = max(0.0, host - kernels) if mesh.device.asynchronous else 0.0
        compute += host_bound
        memory["activations"], memory["working"], _ = beyond_linear(problem, choice, costs)
        tiers = tier_bytes(problem, choice)
        if costs is not None:   # (activations of offloaded layers)
            tiers["host"] += costs.host_bytes(problem, choice)
        comm_by_axis = {mesh.axis_names[a]: self.comm[a] for a in range(mesh.ndim)}
        # a CPU rank's collectives reduce on the cores its compute uses: nothing is hidden there
        overlap = mesh.device.asynchronous
        linear_hidden = self._fold_linears(overlap and problem.edge_prices.folds_tp, costs.kept if costs is not None else frozenset())
        prefetch = hidden_prefetch_seconds(self.forward, self.gathers) if overlap else 0.0
        hidden = (self.hidden_gradients() if overlap else 0.0) + prefetch + sum(linear_hidden.values())
        contended = 0.0
        streamed = {on for d in (*self.gathers.values(), *self.bucketed.values()) for on, t in d.items() if t}
        held = {on for _, sync in (*self.forward.values(), *self.backward.values()) for on, t in sync.items() if t}
        if overlap and streamed & held:   # what the links' sharing costs: the same streams on no named link
            # (the device's own collectives then block nothing: the stream runs through them as through compute)
            free = {name: {i: (own + _seconds(sync), {}) for i, (own, sync) in getattr(self, name).items()}
                    for name in ("forward", "backward")}
            strip = {name: {i: _seconds(d) for i, d in getattr(self, name).items()}
                     for name in ("gathers", "bucketed", "once")}
            contended = max(0.0, hidden_prefetch_seconds(free["forward"], strip["gathers"])
                            + hidden_gradients(free["backward"], strip["bucketed"], strip["once"],
                                               problem.pricing.accumulation) - (hidden - sum(linear_hidden.values())))
        gathered = sum(_seconds(g) for g in self.gathers.values())
        return Prediction(compute + sum(self.comm) - hidden, compute, comm_by_axis, memory, hidden,
                          sum(_seconds(b) for b in self.bucketed.values()) + gathered, prefetch,
                          gathered, host_bound, problem.node_prices.step_memory(choice),
                          {k: v for k, v in tiers.items() if v}, contended, linear_hidden)

    def hidden_gradients(self) -> float:
        """What backward hides of the gradient buckets (`hidden_gradients`)."""
        return hidden_gradients(self.backward, self.bucketed, self.once, self.problem.pricing.accumulation)


def _upstream_param(problem: Problem, index: int) -> int:
    """The first parameter (breadth first) among the ancestors of node `index` (a tensor
    computed from parameters alone whose gradient joins their buckets, GradientPaths.cones),
    or `index` where there is none."""
    todo, seen = [index], {index}
    while todo:
        for src, _ in problem.nodes[todo.pop(0)].inputs:
            if problem.nodes[src].kind == "param":
                return src
            if src not in seen:
                seen.add(src)
                todo.append(src)
    return index


def hidden_gradients(backward: dict, bucketed: dict, once: dict, k: int) -> float:
    """What backward hides of the gradient buckets.  Accumulating (Pricing.accumulation
    k > 1), the buckets that run once per step (`once`, priced at 1/k each micro-step)
    overlap only the last micro-step's backward: their whole seconds against one backward,
    the hidden part shared over the k micro-steps; the buckets of every micro-step (grouped
    ZeRO-3 reduce-scatters) against each.  Values: seconds or {link: seconds}."""
    if not once:
        return hidden_gradient_seconds(backward, bucketed)
    each = {i: {on: t - dict(_by_link(once.get(i, 0.0))).get(on, 0.0) for on, t in _by_link(b)}
            for i, b in bucketed.items()}
    return (hidden_gradient_seconds(backward, each)
            + hidden_gradient_seconds(backward, {i: {on: t * k for on, t in _by_link(b)} for i, b in once.items()}) / k)


# Host seconds of each op of a recomputed layer, in DeviceSpec.host_op, counted in the host's
# time (the step's floor): its forward issued again plus the runtime's recomputation
# machinery (saved-tensor hooks; selective's dispatch mode, which sees every op).  Measured on
# one H200's host, bf16 (docs/gpu/2026-11-26-h200-recompute-profile.txt and
# -gpu_check-after-h100-terms.txt): GPT-2 124M's passes (12 layers of 25 traced ops, batch
# 8 x 1,024) took 38.85 ms, +21.5 with every layer recomputed in full (72 us per op) and
# +28.5 selectively (95 us), while their kernels took 3 ms more; a 4-layer Llama (264 ops)
# +11.4 ms selectively (43 us).  One factor for both modes, 72 us / 27 us: 2.6.  On that
# host-bound model the step grew by the whole host time, more than a floor gives; added
# whole, it made Megatron-LM's published full-recomputation runs, whose kernels are long,
# 15-20 % too slow, so it is a floor.
RECOMPUTE_HOST = 2.6


def _first_readers(problem: Problem) -> dict:
    """Parameter node index -> the first op (in forward order) that reads it: its gradient is
    whole once that op's backward has run."""
    out = {}
    for pn in problem.nodes:
        if pn.kind == "op":
            for src, _ in pn.inputs:
                out.setdefault(src, pn.index)
    return out


def link(mesh, axis: int) -> str | None:
    """The links a collective on mesh `axis` loads, for contention between two streams:
    "nvlink" where the axis lies inside a node (Mesh.inside, as the collectives are priced),
    else "network" (the nodes' NICs are its slowest hop); None on a device that overlaps
    nothing (its streams never meet)."""
    if not mesh.device.asynchronous:
        return None
    return "nvlink" if mesh.inside[axis] else "network"


def _add(by_link: dict, on, seconds: float) -> None:
    by_link[on] = by_link.get(on, 0.0) + seconds


def _seconds(value) -> float:
    """The seconds of a {link: seconds} map, or of a plain number."""
    return sum(value.values()) if isinstance(value, dict) else value


def _by_link(value) -> tuple:
    """(link, seconds) pairs of a {link: seconds} map; a plain number is on no named link."""
    return tuple(value.items()) if isinstance(value, dict) else ((None, value),)


def _run(queue: deque, seconds: float, busy=None) -> None:
    """The communication stream works through `queue` ([link, seconds left] in its order)
    for `seconds` of the device's time, during which the device's own collective holds link
    `busy`: a transfer on that link waits, and the stream, in order, waits behind it.  Two
    transfers on one link share its bandwidth, so the pair takes their sum in either order;
    this gives the device's collective the link first."""
    while seconds > 0 and queue:
        head = queue[0]
        if busy is not None and head[0] == busy:
            return
        step = min(seconds, head[1])
        head[1] -= step
        seconds -= step
        if head[1] <= 0:
            queue.popleft()


def _segments(value) -> tuple:
    """(compute, ((link, seconds) of synchronous communication, ...)) of an op's pass, given as
    that pair or as plain seconds (compute only)."""
    if isinstance(value, (tuple, list)):
        own, sync = value
        return own, _by_link(sync)
    return value, ()


def hidden_prefetch_seconds(forward: dict, gathers: dict) -> float:
    """How much of the weight gathers forward hides (autopar/runtime/regions/reshard.py): two streams, the
    device running each op's forward (its compute, then its synchronous communication) in
    order, and the communication stream gathering weights one ahead: the first gather runs
    when its op is reached, and each gather starts the next one, which runs while the ops up
    to its reader compute.  An op waits for its own gather; what the stream did meanwhile is
    hidden.  A gather makes no progress while the device's own collective holds the same
    links (contention, `_run`).  forward: op index -> seconds, or (compute, {link:
    synchronous seconds}); gathers: op index -> seconds or {link: seconds}."""
    readers = sorted(i for i, t in gathers.items() if _seconds(t) > 0)
    nxt = dict(zip(readers, readers[1:]))
    queue: deque = deque()
    waited = 0.0
    started = set()
    for index in sorted(set(forward) | set(readers)):
        if index in started or index == (readers[0] if readers else None):
            if index in started:   # wait for what is left of its own gather
                waited += sum(left for _, left in queue)
                queue.clear()
            else:                  # the first: nothing ran it ahead
                waited += _seconds(gathers[index])
            if index in nxt:
                queue.extend([on, t] for on, t in _by_link(gathers[nxt[index]]) if t > 0)
                started.add(nxt[index])
        own, sync = _segments(forward.get(index, 0.0))
        _run(queue, own)
        for on, t in sync:
            _run(queue, t, on)
    return max(0.0, sum(_seconds(gathers[i]) for i in readers) - waited)


def hidden_gradient_seconds(backward: dict, bucketed: dict) -> float:
    """How much of the bucketed gradient communication backward hides: two streams, the
    device running each op's backward (its compute, then its synchronous communication) in
    reverse forward order, and the communication stream reducing each gradient bucket once
    the backward of its parameter's first reader has run and the stream is free.  Backward
    ends when both have finished; what the bucket stream did before that is hidden.  A
    bucket makes no progress while the device's own collective holds the same links: a
    ZeRO-3 backward's weight gathers and its gradients' reduce-scatters on one axis, an
    expert all-to-all across nodes and a data-parallel bucket across nodes (contention,
    `_run`).  backward: op index -> (compute, synchronous seconds or {link: seconds});
    bucketed: op index -> seconds or {link: seconds}."""
    queue: deque = deque()
    total = 0.0
    for index in sorted(set(backward) | set(bucketed), reverse=True):
        own, sync = _segments(backward.get(index, (0.0, 0.0)))
        _run(queue, own)
        for on, t in sync:
            _run(queue, t, on)
        for on, t in _by_link(bucketed.get(index, 0.0)):
            if t > 0:
                queue.append([on, t])
                total += t
    return max(0.0, total - sum(left for _, left in queue))
