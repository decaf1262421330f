"""Sub-commands of the `legion-nn` CLI, one module each (see `legion_nn.cli`)."""
