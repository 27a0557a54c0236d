"""The workbench legible at the notebook's width: figures laid out at their box's width, tab
titles whole, preformatted text scrolled rather than wrapped.

plotly's ``FigureWidget`` (an anywidget since plotly 6) lays a figure out once, at 700 px
when its container has no width yet (a tab not shown, an output not attached), and never
again: in a 530 px notebook column its right quarter is cut off, at 1500 px it leaves half
the row empty (plotly.py issue 5208). ``figure_widget`` makes a widget that plotly
re-lays out on request (``responsive``); ``FitToWidth``, an invisible widget placed beside
them, makes that request whenever a figure's box and its layout's width disagree: after
it is drawn, when its tab is shown, when the notebook column changes width. Its style
sheet (``WORKBENCH_CLASS``) lets the tab bar and rows of controls wrap instead of cutting
titles short or running out of the output, and sizes buttons to their text.
"""

from __future__ import annotations

import anywidget
import plotly.graph_objects as go

__all__ = ["FitToWidth", "WORKBENCH_CLASS", "figure_widget"]

WORKBENCH_CLASS = "alpa-lab-workbench"
"""the class of the box the style sheet applies to."""


def figure_widget(fig: go.Figure) -> go.FigureWidget:
    """``fig`` as a widget that re-lays itself out at its box's width when asked (``FitFigures``)."""
    widget = go.FigureWidget(fig)
    widget._config = {**widget._config, "responsive": True}
    return widget


_ESM = """
function fit(gd) {
  // plotly sets _responsiveChartHandler on a responsive plot: a re-layout at the plot's box size
  const laid = gd._fullLayout && gd._fullLayout.width;
  if (laid && gd.clientWidth > 0 && Math.abs(laid - gd.clientWidth) > 1 && gd._responsiveChartHandler) {
    gd._responsiveChartHandler();
  }
}

export default {
  render({ el }) {
    el.style.display = 'none';
    const seen = new WeakSet();
    const sizes = new ResizeObserver(entries => entries.forEach(e => fit(e.target)));
    let root = null, changes = null, tries = 0;
    const scan = () => root.querySelectorAll('.js-plotly-plot').forEach(gd => {
      if (!seen.has(gd)) { seen.add(gd); sizes.observe(gd); }
      fit(gd);
    });
    const drawn = e => { if (root && root.contains(e.detail.element)) fit(e.detail.element); };
    document.addEventListener('plotlywidget-after-render', drawn);
    const attach = () => {  // the view is put into the page after render returns
      root = el.isConnected && el.parentElement ? el.parentElement.closest('.widget-container') : null;
      if (!root) { if (tries++ < 600) requestAnimationFrame(attach); return; }
      changes = new MutationObserver(scan);
      changes.observe(root, { childList: true, subtree: true });
      scan();
    };
    attach();
    return () => {
      document.removeEventListener('plotlywidget-after-render', drawn);
      sizes.disconnect();
      if (changes) changes.disconnect();
    };
  }
};
"""


_CSS = f"""
.{WORKBENCH_CLASS} > .widget-tab > .lm-TabBar .lm-TabBar-content {{ flex-wrap: wrap; }}
.{WORKBENCH_CLASS} > .widget-tab > .lm-TabBar .lm-TabBar-tab {{ flex: 0 0 auto; min-width: fit-content; }}
.{WORKBENCH_CLASS} pre {{ white-space: pre; overflow-x: auto; }}
.{WORKBENCH_CLASS} .jupyter-button {{ width: auto; min-width: fit-content; }}
.{WORKBENCH_CLASS} .widget-hbox {{ flex-wrap: wrap; }}
"""


class FitToWidth(anywidget.AnyWidget):
    """Put it in the box (of class ``WORKBENCH_CLASS``) that holds figure widgets (``figure_widget``):
    it keeps each at the box's width."""

    _esm = _ESM
    _css = _CSS
