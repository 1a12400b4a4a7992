"""Execution of a compiled plan under torchrun."""
from .process import init_process_group

__all__ = ["init_process_group"]
