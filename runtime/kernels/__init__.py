"""Numba kernels: NumPy arrays in, NumPy arrays out; no graph or MPI imports."""
