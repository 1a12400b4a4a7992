"""Jobs for tests/test_semantics.py: the compiled model keeps the module's semantics (train
and eval, dropout streams across ranks, per-rank seeds, no_grad and inference_mode)."""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from autopar.report.plan import Plan
from autopar.runtime import compiled
from rt_cases import OPTIM, _loss, build_case


class DropNet(nn.Module):
    """x: [batch, 16] -> dropout(fc(x)): [batch, width]; the output shows the mask."""

    def __init__(self, width: int = 256, p: float = 0.5):
        super().__init__()
        self.fc = nn.Linear(16, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.fc(x))


def dropnet_case():
    torch.manual_seed(0)
    model = DropNet()
    x = torch.randn(1, 16).expand(64, 16).contiguous()  # identical rows: any mask difference is the mask's
    return model, x


def _all(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def dropout_masks(plan_dict: dict, seed: int | None = None) -> dict:
    """Three train forwards and one eval forward of DropNet under `plan_dict`; what the test
    checks about the masks (see test_semantics.py)."""
    plan = Plan.from_dict(plan_dict)
    model, x = dropnet_case()
    whole = model.fc(x).detach()
    if seed is not None:
        torch.manual_seed(seed + dist.get_rank())  # per-rank seeds (the DDP habit)
    cm = autopar.compile(model, plan.device_mesh(), (x,), plan=plan)
    outs = [cm(x).detach() for _ in range(3)]
    cm.eval()
    evaluated = cm(x).detach()
    cm.train()
    kept = outs[0] != 0
    return {
        "zero_fraction": float((~kept).float().mean()),
        "kept_scaled_exactly": float((outs[0][kept] - 2 * whole[kept]).abs().max()),
        "calls_differ": not torch.equal(outs[0], outs[1]),
        "eval_equals_plain": float((evaluated - whole).abs().max()),
        "digests": _all([_digest(o) for o in outs]),
        "masks": kept,
    }


def eval_then_train(spec: tuple, layout: str, shape: tuple) -> dict:
    """Compile the model in eval mode first, then (same process, same trace cache) in train
    mode; losses next to the plain model's in each mode."""
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh(shape, ("dp", "tp")[:len(shape)], device="cpu")
    model.eval()
    plain_eval = _loss(model(*args, **kwargs)).item()
    cm_eval = autopar.compile(model, mesh, args, example_kwargs=kwargs or None,
                              plan=autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                                                solve=autopar.SolveOptions(compare=False, layout=layout)))
    model.train()
    cm_train = autopar.compile(model, mesh, args, example_kwargs=kwargs or None,
                               plan=autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                                                 solve=autopar.SolveOptions(compare=False, layout=layout)))
    out = {"plain_eval": plain_eval, "eval_mode_of_first": cm_eval.training,
           "eval": [_loss(cm_eval(*args, **kwargs)).item() for _ in range(2)],
           "train": [_loss(cm_train(*args, **kwargs)).item() for _ in range(2)]}
    cm_train.eval()
    out["train_then_eval"] = _loss(cm_train(*args, **kwargs)).item()
    with torch.no_grad():
        out["no_grad"] = _loss(cm_train(*args, **kwargs)).item()
    with torch.inference_mode():
        out["inference_mode"] = _loss(cm_train(*args, **kwargs)).item()
    return out


def per_rank_seeds(spec: tuple, plan_dict: dict, steps: int = 3) -> dict:
    """Seed each rank differently after building the model (the DDP habit), train with
    dropout; return, per parameter, the digests of its local shard on every rank, and the
    losses every rank saw."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    torch.manual_seed(1000 + dist.get_rank())
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    losses = []
    for _ in range(steps):
        losses.append(cm.train_step(*args, **kwargs).item())
        opt.step()
        opt.zero_grad()
    coord = cm.groups.mesh.get_coordinate()
    shards = {cm.name_of[k]: _digest(p) for k, p in cm.shards.items()}
    return {"coord": _all(list(coord)), "shards": _all(shards), "losses": _all(losses)}


def unseeded_models(spec: tuple, plan_dict: dict) -> dict:
    """Each rank builds its model from a different seed (an unseeded script): the compiled
    model starts from rank 0's weights."""
    plan = Plan.from_dict(plan_dict)
    torch.manual_seed(dist.get_rank())
    model, args, kwargs = build_case(spec)  # (build_case seeds 0 itself: perturb afterwards)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    expected = _all({n: p.detach().clone() for n, p in model.named_parameters()})[0]
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    full = cm.full_state_dict()
    return {"max_diff_from_rank0": max(float((full[n] - expected[n]).abs().max()) for n in expected)}


class BNNet(nn.Module):
    """x: [batch, 16] -> MSE of fc2(relu(bn(fc1(x)))) against 0: batch statistics in train
    mode, running statistics in eval mode."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x)))).pow(2).mean()


def bn_case():
    torch.manual_seed(0)
    return BNNet(), torch.randn(32, 16)


def batch_norm_train_eval(plan_dict: dict, steps: int = 2) -> dict:
    """Train BNNet `steps` SGD steps compiled and plain, then evaluate both: train losses,
    eval losses and the running statistics side by side."""
    plan = Plan.from_dict(plan_dict)
    model, x = bn_case()
    plain, _ = bn_case()
    cm = autopar.compile(model, plan.device_mesh(), (x,), plan=plan)
    opt = cm.build_optimizer(torch.optim.SGD, lr=0.1)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    out = {"train": [], "plain_train": []}
    for _ in range(steps):
        out["train"].append(cm.train_step(x).item())
        opt.step()
        opt.zero_grad()
        loss = plain(x)
        loss.backward()
        out["plain_train"].append(loss.item())
        ref.step()
        ref.zero_grad()
    cm.eval()
    plain.eval()
    out["eval"], out["plain_eval"] = cm(x).item(), plain(x).item()
    buffers = {n: b for n, b in cm.named_buffers()}
    out["running_mean"] = float((buffers["bn__running_mean"] - plain.bn.running_mean).abs().max())
    out["batches_tracked"] = (int(buffers["bn__num_batches_tracked"]), int(plain.bn.num_batches_tracked))
    return out


def plan_once(spec: tuple) -> dict:
    """compile(plan=None) with planning broken on every rank but 0: the plan made on rank 0
    reaches every rank."""
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    planned = []
    original = compiled.make_plan   # what compile(plan=None) plans with

    def plan(*a, **k):
        if dist.get_rank() != 0:
            raise AssertionError("only rank 0 plans")
        planned.append(1)
        return original(*a, **k)

    compiled.make_plan = plan
    try:
        cm = autopar.compile(model, mesh, args, example_kwargs=kwargs or None)
    finally:
        compiled.make_plan = original
    return {"planned": len(planned), "hashes": _all(cm.plan.hash()), "loss": cm.train_step(*args, **kwargs).item()}


def train_then_eval_error(module_name: str) -> dict:
    """A model whose eval forward cannot be traced: it trains; cm.eval() names why not."""
    import importlib
    cls = importlib.import_module(module_name)._EvalUntraceable
    torch.manual_seed(0)
    model, x = cls(), torch.randn(8, 4)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    cm = autopar.compile(model, mesh, (x,),
                         plan=autopar.plan(model, mesh, (x,),
                                           solve=autopar.SolveOptions(compare=False, layout="data-parallel")))
    opt = cm.build_optimizer(torch.optim.SGD, lr=0.1)
    steps = 0
    for _ in range(2):
        cm.train_step(x)
        opt.step()
        opt.zero_grad()
        steps += 1
    try:
        cm.eval()
        error = ""
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    return {"steps": steps, "eval_error": error}
