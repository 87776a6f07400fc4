"""Execution-plan search: choose each MFC's device mesh and parallel layout from predicted costs.

ReaLHF (Mei et al. 2024, "ReaLHF: Optimized RLHF Training for Large Language Models through
Parameter Reallocation") showed that the fastest layout differs per model function call and
that a search over per-MFC allocations with a cost model beats a hand-picked layout. This
package is that search, in pure Python (the launcher runs it and never imports torch):

- `realrl.plan.devices`: what a device can do (FLOP/s, memory bandwidth, links), analytic for
  GPUs that are not present, calibrated by a short profiling run for this machine's CPU;
- `realrl.plan.costs`: one MFC's time, communication and peak memory under one layout;
- `realrl.plan.workload`: an experiment's graph turned into the per-MFC work the costs need;
- `realrl.plan.search`: candidate allocations, a step simulated over the graph, exhaustive
  or simulated-annealing search, and the report (`allocation_mode=search`,
  `python -m realrl.apps.plan`).

Design and the cluster-scale table: docs/plan_search.md.
"""
