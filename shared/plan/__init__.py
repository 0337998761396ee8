"""`moemesh plan`: which DEP width serves each phase best, from a step-level model.

Pure functions, no I/O; the CLI (tools/cli/cmd_plan.py) reads files and writes results.

- dims.py: what a token costs in a model (from config.json).
- hardware.py: the published GPU table.
- costs.py: the seam between the model and a machine (Roofline for a GPU, Measured for
  this host); calibrate.py builds Measured from this mesh's benchmark results.
- skew.py, workload.py, host.py: routing skew, request mix, host time per step.
- balance.py: the project's EPLB policy in the loop.
- step.py: one lockstep step and its terms; sweep.py: every width, and the plan.
- report.py: tables and JSON; scenario.py: the seed's findings; check.py: the
  prediction for a run on this host, set against what it measured.

Glossary:
- DEP-N instance: N ranks (GPUs), attention data-parallel, routed experts spread over
  them (shared/model/expert_parallel.py); they step in lockstep.
- width: N. pool: the instances of one phase. rank wait: time a rank spends waiting for
  the others in a step (collectives and the barrier).
- balance ratio: mean / max rank load over MoE layers (shared/eplb/placement.py).
"""
