"""Compiled regions with their backward in two passes (autopar/runtime/regions/split_backward.py),
one process: the cut of a backward graph into the input and the weight passes, the weights'
gradients arriving only when the deferred pass runs, and equal to eager autograd's."""
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.runtime.regions.split_backward import WEIGHT, TwoPassRun, WeightPasses, mark_weights, split_gradients


def _mlp(x, w1, b1, w2):
    return (x + F.linear(F.gelu(F.linear(x, w1, b1)), w2),)


def _two_pass(fn, example, weight):
    gm = make_fx(fn)(*example)
    _, spec = pytree.tree_flatten(fn(*example))
    passes = WeightPasses()
    return TwoPassRun(gm, spec, weight, passes), passes


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal to float rounding (fused kernels reorder operations): within 1e-5 of the
    largest magnitude."""
    assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), (a, b)


def _products(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default)


def test_a_linear_pair_splits_into_two_input_and_two_weight_products():
    """x + W2 gelu(W1 x + b1): B holds the two products that carry the input's gradient
    (dY W2, dH W1), W the two weight products (dY^T h, dH^T x) and the bias's sum; the
    weights have no gradient after B, and after W they and x's equal eager autograd's."""
    torch.manual_seed(0)
    ws = [torch.randn(32, 16), torch.randn(32), torch.randn(16, 32)]
    run, passes = _two_pass(_mlp, (torch.randn(2, 4, 16), *ws), [False, True, True, True])
    params = [w.clone().requires_grad_() for w in ws]
    ref = [w.clone().requires_grad_() for w in ws]
    x = torch.randn(2, 4, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with passes.collecting():
        (y,) = run(x, *[p * 1.0 for p in params])   # (an op on the weights' path, as a cast or gather)
        y.square().sum().backward()
        weight_pass = passes.builder()
    assert all(p.grad is None for p in params) and x.grad is not None
    graphs = next(iter(run.compiled.values()))
    assert _products(graphs.inputs_pass.gm) == 2 and _products(graphs.weights_pass.gm) == 2
    weight_pass()
    _mlp(xr, *[p * 1.0 for p in ref])[0].square().sum().backward()
    _close(x.grad, xr.grad)
    for p, r in zip(params, ref):
        _close(p.grad, r.grad)
    assert (passes.deferred, passes.ran, passes.dropped) == (1, 1, 0)


def test_an_embedding_region_with_no_input_gradient_still_defers_its_weights():
    """Token ids need no gradient and the weights enter detached: the region still takes
    part in backward, and its weights' gradients come with W."""
    def embed(ids, wte, wpe):
        return (F.embedding(ids, wte) + F.embedding(torch.arange(ids.shape[1]), wpe),)
    ids = torch.randint(0, 50, (2, 8))
    ws = [torch.randn(50, 16), torch.randn(8, 16)]
    run, passes = _two_pass(embed, (ids, *ws), [False, True, True])
    params = [w.clone().requires_grad_() for w in ws]
    with passes.collecting():
        run(ids, *params)[0].square().sum().backward()
        weight_pass = passes.builder()
    assert all(p.grad is None for p in params)
    weight_pass()
    ref = [w.clone().requires_grad_() for w in ws]
    embed(ids, *ref)[0].square().sum().backward()
    for p, r in zip(params, ref):
        _close(p.grad, r.grad)


def test_a_backward_outside_the_stage_defers_nothing():
    """The pipeline's metadata inference asks autograd.grad for the input's gradient only:
    what the region would defer there is dropped, and no weight gets a gradient."""
    ws = [torch.randn(32, 16), torch.randn(32), torch.randn(16, 32)]
    run, passes = _two_pass(_mlp, (torch.randn(2, 4, 16), *ws), [False, True, True, True])
    params = [w.clone().requires_grad_() for w in ws]
    x = torch.randn(2, 4, 16, requires_grad=True)
    (dx,) = torch.autograd.grad(run(x, *params)[0].sum(), [x])
    assert dx.shape == x.shape and passes.dropped == 1 and passes.deferred == 0
    assert passes.builder().args == ([],) and all(p.grad is None for p in params)


def test_split_of_a_three_node_backward():
    """bw(x, w, dy) = (dy w, dy^T x): the input pass computes the first, the weight pass
    the second from backward's own inputs (no boundary)."""
    graph = fx.Graph()
    x, w, dy = (graph.placeholder(n) for n in ("x", "w", "dy"))
    dx = graph.call_function(torch.ops.aten.mm.default, (dy, w))
    dyt = graph.call_function(torch.ops.aten.t.default, (dy,))
    dw = graph.call_function(torch.ops.aten.mm.default, (dyt, x))
    graph.output((dx, dw))
    first, second, reads, boundary = split_gradients(fx.GraphModule(torch.nn.Module(), graph), {1})
    assert [n.target for n in first.graph.nodes if n.op == "call_function"] == [torch.ops.aten.mm.default]
    assert [n.target for n in second.graph.nodes if n.op == "call_function"] == [torch.ops.aten.t.default, torch.ops.aten.mm.default]
    assert reads == [0, 2] and boundary == 0


def test_weights_read_by_an_eager_node_stay_in_the_input_pass():
    """mark_weights: a parameter's cast read only by compiled nodes is a weight; one an
    eager node reads too is not (its edge is backwarded in B); an activation never is."""
    graph = fx.Graph()
    x, w, v = (graph.placeholder(n) for n in ("x", "w", "v"))
    wc = graph.call_function(torch.ops.aten.mul.Tensor, (w, 1.0))
    vc = graph.call_function(torch.ops.aten.mul.Tensor, (v, 1.0))
    y = graph.call_function(torch.ops.aten.mm.default, (x, wc))
    z = graph.call_function(torch.ops.aten.mm.default, (y, vc))
    eager = graph.call_function(torch.ops.aten.sum.default, (vc,))
    graph.output((z, eager))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert mark_weights(gm, {"w", "v"}, outside={wc, vc, eager}) == 1
    assert [n for n in gm.graph.nodes if n.meta.get(WEIGHT)] == [wc]
