"""What autopar's runtime costs per training step, next to the PyTorch code a person would write.

Three pairs, each timed in the same run on the same model and global batch:

1. data parallel: `autopar.compile` with layout="data-parallel" on Mesh((4,), ("dp",)) vs
   `torch.nn.parallel.DistributedDataParallel`, each rank feeding DDP its quarter of the
   batch (autopar takes the global batch on every rank and slices its own quarter);
2. tensor parallel: autopar with layout="megatron-tp" on Mesh((4,), ("tp",)) vs torch's
   DTensor tensor parallelism (`parallelize_module`: `ColwiseParallel` for
   blocks.{i}.attn.q/k/v and blocks.{i}.mlp.fc1, `RowwiseParallel` for blocks.{i}.attn.o and
   blocks.{i}.mlp.fc2; embeddings, LayerNorms and lm_head replicated);
3. one device: autopar (the solver's plan, layout=None) on Mesh((1,), ("dp",)) vs the
   eager model.  This pair runs on rank 0 alone, after the 4-rank pairs, in a process
   group of its own (ranks 1-3 have exited), so neither side shares the 2 cores with
   other ranks.

A step is forward + backward (+ gradient synchronisation) + AdamW step + zero_grad.  Each
pair gets `--warmup` untimed steps, then `--steps` timed steps with the two sides
interleaved (A, B, A, B, ...) so that drift in the machine's speed hits both alike.  Every
timed step sits between two `dist.barrier()`s and is timed on rank 0; the median is
reported.  Ratio = compiled / baseline median step time (< 1: autopar is faster); the
targets are printed beside the ratios, not asserted.

Both sides of a pair start from the same weights (copies of one model built with seed 0),
so their losses at step 0 must agree: both are printed (the DDP loss is averaged over the
ranks' quarters to make it the global-batch loss).  After timing, one more step of each side
runs under torch.profiler on rank 0 to count its c10d collective calls (DDP's C++ reducer
and DTensor's functional collectives show up there too).

Model: gpt-tiny (vocab 128, tied embeddings) widened to hidden 256, 8 heads, 4 layers
(3.2 M parameters), global batch 8 x 64 tokens.  On this machine a step takes about 90 ms
on one rank and 120-450 ms on 4 ranks (it varies with the machine's load): long against
the few-ms jitter of a barrier on oversubscribed cores, short enough for 25 steps per side
in the time budget.

Notes on the baselines:
- The GPT attention hard-codes the global head count (`view(batch, seq, self.n_heads,
  head_dim)`) and reshapes back to the input's width (`reshape(batch, seq, hidden)`), which
  a rank holding a quarter of q/k/v cannot do.  For DTensor TP each attention module of the
  baseline's copy gets `n_heads // tp` heads and a forward that is the model's own with the
  last reshape written `reshape(batch, seq, -1)` (`_local_heads_forward`): the same math on
  the local heads, as torchtitan's attention is written for TP.
- autopar's "megatron-tp" layout (the cheapest plan its cost model finds within Megatron's
  rules) also shards the embeddings and the (tied) lm_head on tp, and keeps the residual
  stream between sublayers split on hidden (all-gather before each LayerNorm,
  reduce-scatter after attn.o / mlp.fc2), while the DTensor baseline keeps embeddings,
  norms and head replicated as asked; the linear layers of the blocks are split alike.

4 ranks on this 2-core machine oversubscribe it: every rank runs with one intra-op thread
(OMP_NUM_THREADS=1, also `torch.set_num_threads(1)`).  The whole run takes 35-60 s.

Run:
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 benchmarks/runtime_overhead.py
    ... benchmarks/runtime_overhead.py --steps 30 --warmup 5
    ... benchmarks/runtime_overhead.py --hidden 512 --n-layers 2 --batch 16
    ... benchmarks/runtime_overhead.py --profile    # also cProfile autopar's timed steps on rank 0
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import types
from dataclasses import dataclass, replace

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (torchrun sets it too)

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.models import build

WORLD = 4
OPTIMIZER = torch.optim.AdamW
LR = 1e-4


@dataclass(frozen=True)
class Config:
    model: str = "gpt-tiny"
    hidden: int = 256
    n_heads: int = 8
    n_layers: int = 4
    batch: int = 8   # global batch
    seq: int = 64

    SIZES = ("hidden", "n_heads", "n_layers", "batch", "seq")

    @classmethod
    def add_arguments(cls, parser) -> None:
        """--hidden, --n-heads, --n-layers, --batch, --seq with this config's defaults."""
        default = cls()
        for name in cls.SIZES:
            parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(default, name))

    @classmethod
    def from_args(cls, args) -> "Config":
        return cls(**{name: getattr(args, name) for name in cls.SIZES})

    def build(self):
        torch.manual_seed(0)
        return build(self.model, hidden=self.hidden, n_heads=self.n_heads, n_layers=self.n_layers,
                     batch=self.batch, seq=self.seq)


@dataclass(frozen=True)
class Side:
    """One side of a pair, as measured on rank 0."""

    label: str
    ms: tuple           # step time: (median, 25th, 75th percentile)
    loss0: float        # loss of step 0 on the global batch
    collectives: dict   # c10d collective kind -> calls in one step (torch.profiler on rank 0)

    def comm(self) -> str:
        total = sum(self.collectives.values())
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.collectives.items()))
        return f"{total}" + (f" ({kinds})" if kinds else "")


@dataclass(frozen=True)
class Result:
    case: str
    compiled: Side
    baseline: Side
    target: float  # the ratio compiled / baseline we aim for (at most)

    @property
    def ratio(self) -> float:
        return self.compiled.ms[0] / self.baseline.ms[0]


def init_gloo(world: int, script: str) -> None:
    """Join torchrun's gloo process group of exactly `world` ranks, or exit saying how to launch."""
    if "RANK" not in os.environ:
        raise SystemExit(f"run under torchrun: torchrun --nproc_per_node {world} {script}")
    dist.init_process_group("gloo")
    if dist.get_world_size() != world:
        raise SystemExit(f"this benchmark wants {world} ranks; launch with --nproc_per_node {world}")


def log0(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def make_step(model, optimizer, inputs):
    """One training step of a plain (or DDP / DTensor) module; returns the detached loss."""
    def step():
        loss = model(*inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()
    return step


def make_compiled_step(cm, optimizer, inputs):
    def step():
        loss = cm.train_step(*inputs)
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return step


def count_collectives(step) -> dict:
    """Run one step; on rank 0 under torch.profiler, and return the c10d collectives it issued
    (DDP's C++ reducer and DTensor's functional collectives included), by kind."""
    if dist.get_rank() != 0:
        step()
        return {}
    from torch.profiler import ProfilerActivity, profile
    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.key[len("c10d::"):].rstrip("_"): e.count for e in prof.key_averages()
            if e.key.startswith("c10d::") and "barrier" not in e.key}


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null: the profiler's C++ side logs every start and stop there."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def time_pair(steps: dict, warmup: int, n: int, profile_name: str | None = None) -> dict[str, Side]:
    """label -> Side for each training-step callable in `steps` (label -> step): `warmup`
    untimed steps (the first gives the loss), `n` timed steps interleaved across the sides,
    then one step to count collectives.  With `profile_name`, cProfile that side's timed
    steps (which then run slower)."""
    loss0 = {name: float(fn()) for name, fn in steps.items()}
    for _ in range(warmup - 1):
        for fn in steps.values():
            fn()
    times = {name: [] for name in steps}
    profiler = cProfile.Profile() if profile_name else None
    for _ in range(n):
        for name, fn in steps.items():
            on = profiler is not None and name == profile_name
            dist.barrier()
            start = time.perf_counter()
            if on:
                profiler.enable()
            fn()
            dist.barrier()
            if on:
                profiler.disable()
            times[name].append(time.perf_counter() - start)
    if profiler is not None and dist.get_rank() == 0:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime")
        out.write(f"--- cProfile of {n} timed steps of {profile_name} on rank 0 ---\n")
        stats.print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)
        print(out.getvalue(), flush=True)
    comm = {name: count_collectives(fn) for name, fn in steps.items()}
    return {name: Side(name, summary(times[name]), loss0[name], comm[name]) for name in steps}


def summary(seconds: list) -> tuple:
    q1, _, q3 = statistics.quantiles(seconds, n=4)
    return statistics.median(seconds) * 1e3, q1 * 1e3, q3 * 1e3


# ------------------------------------------------------------------------- the pairs

def data_parallel(cfg: Config, warmup: int, n: int, profile: bool) -> Result:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model, example = cfg.build()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = autopar.Mesh((world,), ("dp",), device="cpu")
    compiled_model = copy.deepcopy(model)  # compile may keep the model's tensors as its shards
    plan = autopar.plan(compiled_model, mesh, example,
                        solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    cm = autopar.compile(compiled_model, mesh, example, plan=plan)
    compiled = make_compiled_step(cm, cm.build_optimizer(OPTIMIZER, lr=LR), example)

    ddp = DDP(copy.deepcopy(model))
    share = cfg.batch // world
    local = tuple(t[rank * share:(rank + 1) * share] for t in example)
    baseline = make_step(ddp, OPTIMIZER(ddp.parameters(), lr=LR), local)
    name = "autopar data-parallel"
    out = time_pair({name: compiled, "DDP": baseline}, warmup, n, name if profile else None)
    ddp_loss0 = torch.tensor(out["DDP"].loss0)  # this rank's quarter's mean; the global mean is their mean
    dist.all_reduce(ddp_loss0)
    ddp_side = replace(out["DDP"], loss0=float(ddp_loss0) / world)
    return Result("data parallel, 4 ranks", out[name], ddp_side, 1.02)


def _local_heads_forward(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward on this rank's heads: q/k/v are [batch, seq, hidden / tp]
    (ColwiseParallel outputs, local), `self.n_heads` is the local head count."""
    batch, seq, _ = x.shape
    q = self.q(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
    k = self.k(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
    v = self.v(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                       is_causal=True)
    y = y.transpose(1, 2).reshape(batch, seq, -1)  # [batch, seq, hidden / tp]
    return self.resid_dropout(self.o(y))


def dtensor_tp(model, tp: int):
    """A copy of `model` with torch's Megatron-style tensor parallelism over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    plan = {}
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if attn.n_heads % tp:
            raise ValueError(f"n_heads={attn.n_heads} does not divide by tp={tp}")
        attn.n_heads //= tp
        attn.forward = types.MethodType(_local_heads_forward, attn)
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.fc2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def tensor_parallel(cfg: Config, warmup: int, n: int, profile: bool) -> Result:
    model, example = cfg.build()
    world = dist.get_world_size()
    mesh = autopar.Mesh((world,), ("tp",), device="cpu")
    compiled_model = copy.deepcopy(model)
    plan = autopar.plan(compiled_model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="megatron-tp"))
    cm = autopar.compile(compiled_model, mesh, example, plan=plan)
    compiled = make_compiled_step(cm, cm.build_optimizer(OPTIMIZER, lr=LR), example)

    tp_model = dtensor_tp(model, world)
    baseline = make_step(tp_model, OPTIMIZER(tp_model.parameters(), lr=LR), example)
    name = "autopar megatron-tp"
    out = time_pair({name: compiled, "DTensor TP": baseline}, warmup, n, name if profile else None)
    return Result("tensor parallel, 4 ranks", out[name], out["DTensor TP"], 1.00)


def single_device(cfg: Config, warmup: int, n: int, profile: bool) -> Result:
    """Rank 0 alone, in a 1-rank process group of its own (autopar.compile needs the default
    group's size to equal the mesh's)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, example = cfg.build()
        mesh = autopar.Mesh((1,), ("dp",), device="cpu")
        compiled_model = copy.deepcopy(model)
        plan = autopar.plan(compiled_model, mesh, example, solve=autopar.SolveOptions(compare=False))
        cm = autopar.compile(compiled_model, mesh, example, plan=plan)
        compiled = make_compiled_step(cm, cm.build_optimizer(OPTIMIZER, lr=LR), example)
        eager_model = copy.deepcopy(model)
        eager = make_step(eager_model, OPTIMIZER(eager_model.parameters(), lr=LR), example)
        name = "autopar Mesh((1,))"
        out = time_pair({name: compiled, "eager": eager}, warmup, n, name if profile else None)
    finally:
        dist.destroy_process_group()
    return Result("one device (rank 0 alone)", out[name], out["eager"], 1.02)


# ------------------------------------------------------------------------- report

def report(cfg: Config, model_params: int, results: list[Result], warmup: int, n: int, seconds: float,
           profiled: bool) -> None:
    print()
    print(f"model: {cfg.model} hidden={cfg.hidden} n_heads={cfg.n_heads} n_layers={cfg.n_layers}, "
          f"{model_params / 1e6:.2f} M parameters (tied embeddings counted once)")
    print(f"global batch: {cfg.batch} sequences x {cfg.seq} tokens; {WORLD} gloo ranks on {os.cpu_count()} CPU "
          f"cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} (1 intra-op thread per rank), "
          f"torch {torch.__version__}")
    print(f"step = forward + backward + {OPTIMIZER.__name__} step + zero_grad; {warmup} warm-up steps, then "
          f"{n} timed steps per side, sides interleaved, barrier before and after each step, timed on rank 0")
    if profiled:
        print("NOTE: --profile was on: autopar's steps ran under cProfile, so the ratios are biased against it")
    print()

    def ms(t):
        return f"{t[0]:7.1f} [{t[1]:.0f}-{t[2]:.0f}]"

    head = (f"{'case':<27}{'compiled':<23}{'ms/step [IQR]':>19}  {'baseline':<11}{'ms/step [IQR]':>19}  "
            f"{'ratio':>6}  target")
    print(head)
    print("-" * len(head))
    for r in results:
        mark = "met" if r.ratio <= r.target else "missed"
        print(f"{r.case:<27}{r.compiled.label:<23}{ms(r.compiled.ms):>19}  {r.baseline.label:<11}"
              f"{ms(r.baseline.ms):>19}  {r.ratio:>6.3f}  <= {r.target:.2f} ({mark})")
    print()
    print("loss at step 0 (global batch), compiled vs baseline:")
    for r in results:
        print(f"  {r.case:<27}{r.compiled.loss0:.7f} vs {r.baseline.loss0:.7f}  "
              f"(|diff| {abs(r.compiled.loss0 - r.baseline.loss0):.1e})")
    print()
    print("collective calls per step on rank 0 (torch.profiler, c10d ops), compiled vs baseline:")
    for r in results:
        print(f"  {r.case:<27}{r.compiled.comm()} vs {r.baseline.comm()}")
    print(f"\ntotal run time {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="cProfile autopar's timed steps on rank 0")
    Config.add_arguments(parser)
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(1)
    cfg = Config.from_args(args)
    if cfg.batch % WORLD or cfg.n_heads % WORLD:
        raise SystemExit(f"batch ({cfg.batch}) and n_heads ({cfg.n_heads}) must divide by {WORLD}")
    init_gloo(WORLD, __file__)
    rank = dist.get_rank()
    results = []
    for case in (data_parallel, tensor_parallel):
        log0(f"[{time.perf_counter() - start:5.1f}s] {case.__name__} ...")
        results.append(case(cfg, args.warmup, args.steps, args.profile))
    dist.destroy_process_group()
    if rank != 0:
        return
    log0(f"[{time.perf_counter() - start:5.1f}s] single_device (rank 0 alone) ...")
    results.append(single_device(cfg, args.warmup, args.steps, args.profile))
    model, _ = cfg.build()
    report(cfg, sum(p.numel() for p in model.parameters()), results, args.warmup, args.steps,
           time.perf_counter() - start, args.profile)


if __name__ == "__main__":
    main()
