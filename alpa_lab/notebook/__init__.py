"""The notebook workbench: the ``%%parallelize`` magic, the plan views and the widget.

``views`` computes what is shown (plain data), ``render`` draws it (plotly, static HTML),
``workbench`` is the widget that holds a plan and its edits, ``magic`` the cell magic.
"""

from alpa_lab.notebook.workbench import Workbench

__all__ = ["Workbench"]
