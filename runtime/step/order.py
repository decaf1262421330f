"""The order in which a rank runs a step's tasks (`step_order`), which every rank shares."""

from __future__ import annotations

import heapq
from collections import defaultdict

from legion_nn.graph import TaskGraph


def step_order(graph: TaskGraph) -> list[int]:
    """Task indices in the order a rank runs them: every `update` task as late as it may go.

    A topological order of the graph's dependences that takes the other tasks first, each in
    its graph order; updates go when nothing else can. Should deferring the updates ever
    reorder two other tasks (one waiting on an update), the graph's own order is kept instead,
    so that reductions into one tensor always add up in the same order on every rank count.
    """
    tasks = graph.tasks
    position = {task.name: i for i, task in enumerate(tasks)}
    successors: dict[int, list[int]] = defaultdict(list)
    waiting = [0] * len(tasks)
    for dep in graph.dependences:
        src, dst = position[dep.src], position[dep.dst]
        successors[src].append(dst)
        waiting[dst] += 1
    ready = [(tasks[i].phase == "update", i) for i in range(len(tasks)) if waiting[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, (tasks[j].phase == "update", j))
    others = [i for i in order if tasks[i].phase != "update"]
    if len(order) != len(tasks) or others != sorted(others):
        return list(range(len(tasks)))
    return order
