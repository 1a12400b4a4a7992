"""Execution of a compiled plan under torchrun."""
