"""legion-nn: a distributed task-graph compiler with region partitioning for NN training.

This package is the IR and the front end: `Rect`, `Tensor`, `Task`, `Requirement`, `TaskGraph`,
`verify`, the layers with their access maps, the networks and the command line.
"""

from legion_nn.errors import LegionNNError
from legion_nn.graph import Dependence, TaskGraph
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect

__all__ = [
    "Dependence",
    "LegionNNError",
    "Privilege",
    "Rect",
    "Requirement",
    "Task",
    "TaskGraph",
    "Tensor",
]
