"""Measurement: one timing method (`timing`), the device model and its measured ceilings
(`device`), the results store (`results`) and roofline arithmetic (`roofline`).

Nothing is re-exported here, so loading results in a notebook does not import Triton kernels.
"""
