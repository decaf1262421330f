"""`auto`'s search: the grids of each layer, their parameters' homes, and pipeline stages.

- `auto.auto` chooses each unit's grid by a DP over the units in program order: on a chain
  (`coupling`) over transitions between neighbours, else over each row's dependencies
  (`frontier_dp`); a local search where neither tabulates.
- A row's seconds and memory under given grids come from replaying its window of tasks
  (`transitions.UnitPricer`, over `unit_windows`), each step priced once and kept by what it
  depends on (`task_prices`, `layout_cache`); `families` names the grids tried.
- `memory_fit` fits the chosen grids in a rank's memory by sharding parameters' homes and
  picks among candidates by the predicted step; `stages` chooses pipeline stages and
  micro-batches around all of it.
"""
