"""The tools above the services: the CLI, the launcher, benchmarks and profiling.

Layers import downward only: tools -> services -> shared. Nothing in `shared/` or
`services/` imports from here.
"""
