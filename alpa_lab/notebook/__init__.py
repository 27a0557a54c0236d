"""The notebook workbench: the ``%%parallelize`` magic (and, to come, the plan views)."""
