"""The rank graph's regions at run time: random ops on their streams (rng.py), recomputed
layers (recompute.py), ZeRO-3's weights gathered again for backward (reshard.py,
gathered.py), and Inductor-compiled regions (inductor.py) with their pieces
(split_backward.py, compiled_checkpoint.py, sigmoid_gelu.py, functional_moves.py)."""
