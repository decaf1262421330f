"""`python -m cli ARGS` runs `legion-nn ARGS`."""

from cli.main import entry

entry()
