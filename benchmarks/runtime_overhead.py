"""What autopar's runtime costs per training step, next to the PyTorch code a person would write.

Three pairs, each timed in the same run on the same model and global batch:

1. data parallel: `autopar.compile` with layout="data-parallel" on Mesh((4,), ("dp",)) vs
   `torch.nn.parallel.DistributedDataParallel`, each rank feeding DDP its quarter of the
   batch (autopar takes the global batch on every rank and slices its own quarter);
2. tensor parallel: autopar with layout="megatron-tp" on Mesh((4,), ("tp",)) vs torch's
   DTensor tensor parallelism (`parallelize_module`: `ColwiseParallel` for
   blocks.{i}.attn.q/k/v and blocks.{i}.mlp.fc1, `RowwiseParallel` for blocks.{i}.attn.o and
   blocks.{i}.mlp.fc2; embeddings, LayerNorms and lm_head replicated);
3. one device: autopar on Mesh((1,), ("dp",)) vs the eager model.  This pair runs on rank 0
   alone, after the 4-rank pairs, in a process group of its own (ranks 1-3 have exited), so
   neither side shares the 2 cores with other ranks.

A step is forward + backward (+ gradient synchronisation) + AdamW step + zero_grad.  Each
pair gets `--warmup` untimed steps, then `--steps` timed steps with the two sides
interleaved (A, B, A, B, ...) so that drift in the machine's speed hits both alike.  Every
timed step sits between two `dist.barrier()`s and is timed on rank 0; the median is
reported.  Ratio = compiled / baseline median step time (< 1: autopar is faster); the
targets are printed beside the ratios, not asserted.

Both sides of a pair start from the same weights (copies of one model built with seed 0),
so their losses at step 0 must agree: both are printed (the DDP loss is averaged over the
ranks' quarters to make it the global-batch loss).

Notes on the baselines:
- The GPT attention hard-codes the global head count (`view(batch, seq, self.n_heads,
  head_dim)`) and reshapes back to the input's width (`reshape(batch, seq, hidden)`), which
  a rank holding a quarter of q/k/v cannot do.  For DTensor TP each attention module of the
  baseline's copy gets `n_heads // tp` heads and a forward that is the model's own with the
  last reshape written `reshape(batch, seq, -1)` (`_local_heads_forward`): the same math on
  the local heads, as torchtitan's attention is written for TP.
- autopar's "megatron-tp" layout also shards the embeddings and the (tied) lm_head on tp
  (vocabulary-parallel embedding and cross-entropy), while the DTensor baseline keeps them
  replicated as asked; the linear layers of the blocks are split alike.

4 ranks on this 2-core machine oversubscribe it: every rank runs with one intra-op thread
(OMP_NUM_THREADS=1, also `torch.set_num_threads(1)`).  The whole run takes about 1-2 min.

Run:
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 benchmarks/runtime_overhead.py
    ... benchmarks/runtime_overhead.py --steps 30 --warmup 5
    ... benchmarks/runtime_overhead.py --profile    # also cProfile autopar's timed steps on rank 0
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import time
import types
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch reads it

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

    def build(self):
        torch.manual_seed(0)
        return build(self.model, hidden=self.hidden, n_heads=self.n_heads, n_layers=self.n_layers,
                     batch=self.batch, seq=self.seq)


@dataclass(frozen=True)
class Result:
    case: str
    compiled: str
    baseline: str
    compiled_ms: tuple      # step time: (median, 25th, 75th percentile)
    baseline_ms: tuple
    compiled_loss0: float   # global-batch loss of step 0
    baseline_loss0: float
    target: float           # the ratio we aim for (at most)

    @property
    def ratio(self) -> float:
        return self.compiled_ms[0] / self.baseline_ms[0]


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


def time_pair(steps: dict, warmup: int, n: int, profile_name: str | None = None) -> tuple[dict, dict]:
    """Run `warmup` then `n` interleaved steps of each callable; returns (name -> step-0 loss,
    name -> step ms on rank 0 as (median, 25th, 75th percentile)).  With `profile_name`,
    cProfile that side's timed steps (which then run slower)."""
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    loss0 = {name: float(fn()) for name, fn in steps.items()}
    for _ in range(warmup - 1):
        for fn in steps.values():
            fn()
    times = {name: [] for name in steps}
    profiler = cProfile.Profile() if profile_name else None
    for _ in range(n):
        for name, fn in steps.items():
            sync()
            on = profiler is not None and name == profile_name
            start = time.perf_counter()
            if on:
                profiler.enable()
            fn()
            sync()
            if on:
                profiler.disable()
            times[name].append(time.perf_counter() - start)
    if profiler is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime")
        out.write(f"--- cProfile of {n} timed steps of {profile_name} on rank 0, by own time ---\n")
        stats.print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)
        print(out.getvalue(), flush=True)
    return loss0, {name: _summary(t) for name, t in times.items()}


def _summary(seconds: list) -> tuple:
    q1, _, q3 = statistics.quantiles(seconds, n=4)
    return statistics.median(seconds) * 1e3, q1 * 1e3, q3 * 1e3


# ------------------------------------------------------------------------- the pairs

def data_parallel(cfg: Config, warmup: int, n: int, profile: bool) -> Result:
    from torch.nn.parallel import DistributedDataParallel as DDP
    model, example = cfg.build()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = autopar.Mesh((world,), ("dp",), device="cpu")
    compiled_model = copy.deepcopy(model)  # compile may keep the model's tensors as its shards
    plan = autopar.plan(compiled_model, mesh, example, compare=False, layout="data-parallel")
    cm = autopar.compile(compiled_model, mesh, example, plan=plan)
    compiled = make_compiled_step(cm, cm.build_optimizer(OPTIMIZER, lr=LR), example)

    ddp = DDP(copy.deepcopy(model))
    share = cfg.batch // world
    local = tuple(t[rank * share:(rank + 1) * share] for t in example)
    baseline = make_step(ddp, OPTIMIZER(ddp.parameters(), lr=LR), local)
    loss0, med = time_pair({"autopar": compiled, "ddp": baseline}, warmup, n,
                           "autopar" if profile else None)
    ddp_loss0 = torch.tensor(loss0["ddp"])  # this rank's quarter's mean; the global mean is their mean
    dist.all_reduce(ddp_loss0)
    return Result("data parallel, 4 ranks", "autopar data-parallel", "DDP", med["autopar"],
                  med["ddp"], loss0["autopar"], float(ddp_loss0) / world, 1.05)


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
    plan = autopar.plan(compiled_model, mesh, example, compare=False, layout="megatron-tp")
    cm = autopar.compile(compiled_model, mesh, example, plan=plan)
    compiled = make_compiled_step(cm, cm.build_optimizer(OPTIMIZER, lr=LR), example)

    tp_model = dtensor_tp(model, world)
    baseline = make_step(tp_model, OPTIMIZER(tp_model.parameters(), lr=LR), example)
    loss0, med = time_pair({"autopar": compiled, "dtensor": baseline}, warmup, n,
                           "autopar" if profile else None)
    return Result("tensor parallel, 4 ranks", "autopar megatron-tp", "DTensor TP", med["autopar"],
                  med["dtensor"], loss0["autopar"], loss0["dtensor"], 1.00)


def single_device(cfg: Config, warmup: int, n: int, profile: bool) -> Result:
    """Rank 0 alone, in a 1-rank process group of its own (autopar.compile needs the default
    group's size to equal the mesh's)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, example = cfg.build()
        mesh = autopar.Mesh((1,), ("dp",), device="cpu")
        compiled_model = copy.deepcopy(model)
        plan = autopar.plan(compiled_model, mesh, example, compare=False)
        cm = autopar.compile(compiled_model, mesh, example, plan=plan)
        compiled = make_compiled_step(cm, cm.build_optimizer(OPTIMIZER, lr=LR), example)
        eager_model = copy.deepcopy(model)
        eager = make_step(eager_model, OPTIMIZER(eager_model.parameters(), lr=LR), example)
        loss0, med = time_pair({"autopar": compiled, "eager": eager}, warmup, n,
                               "autopar" if profile else None)
    finally:
        dist.destroy_process_group()
    return Result("one device (rank 0 alone)", "autopar, Mesh((1,))", "eager", med["autopar"],
                  med["eager"], loss0["autopar"], loss0["eager"], 1.02)


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
        print(f"{r.case:<27}{r.compiled:<23}{ms(r.compiled_ms):>19}  {r.baseline:<11}{ms(r.baseline_ms):>19}  "
              f"{r.ratio:>6.3f}  <= {r.target:.2f} ({mark})")
    print()
    print("loss at step 0 (global batch), compiled vs baseline:")
    for r in results:
        print(f"  {r.case:<27}{r.compiled_loss0:.7f} vs {r.baseline_loss0:.7f}  "
              f"(|diff| {abs(r.compiled_loss0 - r.baseline_loss0):.1e})")
    print(f"\ntotal run time {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="cProfile autopar's timed steps on rank 0")
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(1)
    cfg = Config()
    if "RANK" not in os.environ:
        raise SystemExit(f"run under torchrun: torchrun --nproc_per_node {WORLD} {__file__}")
    dist.init_process_group("gloo")
    if dist.get_world_size() != WORLD:
        raise SystemExit(f"this benchmark wants {WORLD} ranks; launch with --nproc_per_node {WORLD}")
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
