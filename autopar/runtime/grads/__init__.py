"""A rank's gradients: pieces marked so norms refuse them (pieces.py), the whole model's norm
and clipping (norms.py), ZeRO-1/2's chunks (zero.py), bucketed reduction overlapped with
backward (sync.py), and TP collectives beside their linears' GEMMs (linear.py)."""
