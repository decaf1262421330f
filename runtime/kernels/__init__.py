"""Numba kernels: NumPy arrays in, NumPy arrays out; no graph or MPI imports.

`filter` and `conv` take the logical layouts of the design; `filter_packed` and the `*_packed`
functions of `conv` run on the packed layouts of `layout`, which an executor keeps
across training steps. `reference` holds the plain NumPy oracles.

Importing them changes no environment: the `legion-nn` command sets OpenMP's spin count for its
process (`legion_nn.cli.OPENMP_SPIN_POLLS` says why).
"""
