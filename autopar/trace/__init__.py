"""Stage 1, tracing: an nn.Module and example inputs to the ATen training-IR graph, on fake tensors.

export.py (torch.export and the tracing cache), unroll.py (a deep model traced through three
layers), rebatch.py (the graph at another batch size), fused.py / experts.py / attention.py
(graph rewrites that make fused projections, mixture-of-experts layers and windowed attention
one planned op), batching.py (the batch dimension of the inputs)."""
