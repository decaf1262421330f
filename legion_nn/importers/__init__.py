"""Importers: graphs recorded by other frameworks, read into legion-nn's IR.

`chainer` parses Chainer graph dumps (variables with byte sizes, forward and backward function
records); `chainer_graph` turns a parsed dump into a `TaskGraph`.
"""

from legion_nn.importers.chainer import Dump, Function, Input, Variable, parse_dump
from legion_nn.importers.chainer_graph import import_dump

__all__ = ["Dump", "Function", "Input", "Variable", "import_dump", "parse_dump"]
