"""Kernel sources (CUDA C and the fused CPU tile), loaded and compiled at run time."""
