"""Execution of a compiled plan under torchrun."""
from autopar.runtime.process import init_process_group

__all__ = ["init_process_group"]
