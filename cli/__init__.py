"""The `legion-nn` command line: the top layer, which may import every package and which none
imports (`cli.main` parses, `cli.commands` holds one module per sub-command)."""
