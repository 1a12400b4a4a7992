"""Predicted step of the solver's plan against hand-written layouts for real Hugging Face
architectures on a (dp=8, tp=8) H100 mesh, planned on meta tensors in one process.

    python benchmarks/hf_plans.py [phi3|mixtral ...] [--batch 16]

- Phi-3-mini (3.8 B, fused qkv_proj and gate_up_proj, weight-dominated): baseline
  "megatron-tp x dp" (Megatron on tp, data parallel on dp).
- Mixtral 8x7B (47 B, 8 experts, top-2): baselines "megatron-tp x dp" (every expert's
  inner dim split on tp) and "expert-parallel" (experts split over tp, tokens dispatched by
  all-to-all, the rest data parallel).

Prints each plan's predicted step, memory per device and the ratio baseline / solver
(above 1: the solver's plan is faster).  Hand-written layouts are planned without the
memory budget, so their memory may exceed the device's (it is printed).
"""
from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch

import autopar


def phi3():
    import transformers as tf
    return tf.Phi3ForCausalLM(tf.Phi3Config(vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                            use_cache=False, pad_token_id=0))


def mixtral():
    import transformers as tf
    return tf.MixtralForCausalLM(tf.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                                  num_local_experts=8, num_experts_per_tok=2, use_cache=False))


MODELS = {"phi3": (phi3, ["megatron-tp x dp"]), "mixtral": (mixtral, ["megatron-tp x dp", "expert-parallel"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--batch", type=int, default=16, help="sequences of 2048 tokens per step")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    ids = torch.zeros((args.batch, 2048), dtype=torch.long, device="meta")
    kwargs = {"input_ids": ids, "labels": ids}
    for name in args.models:
        make, baselines = MODELS[name]
        with torch.device("meta"):
            model = make()
        start = time.perf_counter()
        ilp = autopar.plan(model, mesh, example_kwargs=kwargs, solve=autopar.SolveOptions(compare=False))
        took = time.perf_counter() - start
        gib = sum(ilp.predicted.memory.values()) / 2**30
        print(f"{name} batch {args.batch} x 2048 on {mesh}: solver {ilp.predicted.step_s * 1e3:.1f} ms, "
              f"{gib:.1f} GiB/device (planned in {took:.1f} s)")
        experts = sorted({n.strategy for n in ilp.nodes if n.op == "autopar.experts"})
        if experts:
            print(f"  solver's experts: {', '.join(experts)}")
        for layout in baselines:
            try:
                base = autopar.plan(model, mesh, example_kwargs=kwargs,
                                    solve=autopar.SolveOptions(compare=False, layout=layout))
            except Exception as exc:  # a layout no plan of which exists on this mesh
                print(f"  {layout}: {str(exc)[:200]}")
                continue
            gib = sum(base.predicted.memory.values()) / 2**30
            print(f"  {layout}: {base.predicted.step_s * 1e3:.1f} ms, {gib:.1f} GiB/device; "
                  f"ratio {layout} / solver = {base.predicted.step_s / ilp.predicted.step_s:.3f}")


if __name__ == "__main__":
    main()
