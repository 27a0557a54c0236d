"""Operator clustering into layers (eq. 6): the DP lives in ``graph.layering``, below the passes,
because automatic layering runs it while tracing (``graph.markers.auto_layers``); its names are
re-exported here for code that imports them from the passes."""

from alpa_lab.graph.layering import Layering, brute_force_layers, cluster_layers, input_bytes_table

__all__ = ["Layering", "brute_force_layers", "cluster_layers", "input_bytes_table"]
