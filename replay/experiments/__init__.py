"""Experiments on the attention kernels: the papers' numerics measurements, their files, plots and verdicts."""
