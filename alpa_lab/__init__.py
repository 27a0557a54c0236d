"""alpa_lab: Alpa's automatic parallelization planner on stock JAX, as a workbench."""
