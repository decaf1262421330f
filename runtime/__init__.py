"""Kernels, the local and rank executors, their transports (threads, MPI), optimizers,
checkpoints and tracing."""
