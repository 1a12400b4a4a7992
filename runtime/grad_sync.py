"""Gradient synchronisation of parameter shards.

The collectives pass reduces most gradients inside autograd (each move's backward is the
dual collective).  This module owns what is left to the end of backward.
"""
from __future__ import annotations


class GradSync:
    def __init__(self, module, bucket_mb: float):
        self.module = module
        self.bucket_bytes = bucket_mb * 2**20

    def finish(self) -> None:
        """Called after backward: nothing is pending when every reduction ran inside autograd."""
