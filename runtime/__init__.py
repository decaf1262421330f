"""Kernels, the local and MPI executors, optimizers, checkpoints and tracing."""
