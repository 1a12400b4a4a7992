"""Stage 1, tracing: an nn.Module and example inputs to the ATen training-IR graph, on fake tensors.

export.py (torch.export), cache.py (the process's trace cache and the outline exchange
between processes), unroll.py (a deep model traced through three layers), rebatch.py (the
graph at another batch size), paths.py (module paths and the layer a path is in), fused.py /
experts.py / attention.py (graph rewrites that make fused projections, mixture-of-experts
layers and windowed attention one planned op), batching.py (the batch dimension of the inputs)."""
