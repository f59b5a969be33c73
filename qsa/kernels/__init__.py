"""Triton kernels, one family per module; block configs come from qsa/configs/tables."""
