"""The ``%%parallelize`` cell magic (``%load_ext alpa_lab``).

The cell defines a training step; the magic runs the cell, wraps the step it defines with
``alpa_lab.parallelize`` (so calling it runs the current plan), and, given the names of
example arguments, plans it right away and binds the plan to a name. Option errors are
short ``UsageError``s that say what to change; an error in the user's own code keeps its
traceback pointing at the user's line.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import sys
import types
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from tqdm.auto import tqdm

import alpa_lab as al
from alpa_lab.graph.trace import TraceError
from alpa_lab.passes.schedule import SCHEDULES

__all__ = ["ParallelizeMagics", "load_ipython_extension"]

_UNSET = object()


def _library_file(filename: str) -> bool:
    """Frames of alpa_lab, JAX, flax and the standard library are not the user's."""
    return "site-packages" in filename or f"{os.sep}alpa_lab{os.sep}" in filename or filename.startswith(sys.prefix)


def _defined_function(cell: str) -> str:
    """The name of the last top-level function the cell defines."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return ""  # the cell's own error is raised when it runs
    names = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return names[-1] if names else ""


@magics_class
class ParallelizeMagics(Magics):
    """Holds the ``%%parallelize`` magic; the last step it made is ``self.last_step``."""

    last_step: Any = None
    last_workbench: Any = None

    @magic_arguments()
    @argument("--cluster", default=None, help="local:HxD (simulated devices), gpu:HxD (this machine's GPUs) or "
              "PRESET:HOSTS, e.g. p3.16xlarge:8; default: the devices JAX has here")
    @argument("--ray", default=None, help="plan for and run on a Ray cluster: local:HxD (started here on 127.0.0.1), auto or "
              "HOST:PORT (with --cluster HxD: that part of it)")
    @argument("--microbatches", type=int, default=None, help="pipeline the step over this many micro-batches")
    @argument("--schedule", default="1f1b", help=f"pipeline schedule: {', '.join(sorted(SCHEDULES))} (inference: a step without gradients)")
    @argument("--layers", type=int, default=None, help="layers the automatic layering cuts the step into")
    @argument("--method", default="alpa", help=f"planning method: {', '.join(al.METHODS)}")
    @argument("--max-stages", type=int, default=None, help="at most this many pipeline stages")
    @argument("--cost-model", default="analytic", help="analytic (FLOPs, bytes, links) or profile (stages timed on the devices)")
    @argument("--submesh-space", default="all", help="whole-host sub-meshes the stage DP tries: all or power_of_two (fast on many hosts)")
    @argument("--logical-meshes", default="all", help="logical meshes the stage DP tries per sub-mesh: all, "
              "single_node_model_parallel (Alpa's: model parallelism inside a host), same_as_physical, data_parallel_only "
              "or model_parallel_only")
    @argument("--remat", action="store_true", help="recompute each pipeline layer in the backward (jax.checkpoint per layer): less memory")
    @argument("--device-memory", type=float, default=None, help="GiB per device (default: the cluster's), e.g. to see memory limits")
    @argument("--memory-budget", type=str, default=None, help="bytes per device (single-mesh plans): 16e9 or 16GB")
    @argument("--batch-argnums", default=None, help="comma-separated positions of the step's batch arguments, e.g. 1 "
              "or =-1 (negative ones after '='; default: the data leaves that share the batch size)")
    @argument("--args", default=None, help="comma-separated names of example arguments to plan with, e.g. state,batch")
    @argument("--name", default=None, help="bind the plan to this name (edits in the workbench re-bind it)")
    @argument("--workbench", default=None, help="bind the workbench to this name too")
    @argument("--no-display", action="store_true", help="plan, but do not show the workbench")
    @argument("-h", "--help", action="store_true", help="show this help and do nothing else")
    @cell_magic
    def parallelize(self, line: str, cell: str) -> Any:
        """Run the cell, parallelize the step it defines, and plan it with ``--args``.

        The step's name is rebound to the parallelized step: calling it runs the current plan.
        The cell's result is the workbench, bound to ``--workbench`` if given; its edits
        re-bind ``--name`` and become the step's plan.
        """
        opts = parse_argstring(self.parallelize, line)
        if opts.help:
            print(self.parallelize.__doc__)
            return None
        ns = self.shell.user_ns
        fn_name = _defined_function(cell)
        if not fn_name:
            raise UsageError("%%parallelize: the cell must define the training step as a top-level `def`")
        ray_cluster = None
        if opts.ray is not None:
            ray_cluster = self._ray_cluster(opts.ray)
            cluster = ray_cluster.spec if opts.cluster is None else self._part(ray_cluster, opts.cluster)
        else:
            cluster = self._cluster(opts.cluster)
        if opts.method not in al.METHODS:
            raise UsageError(f"%%parallelize: unknown --method {opts.method!r}; choose one of {', '.join(al.METHODS)}")
        names = [a.strip() for a in opts.args.split(",") if a.strip()] if opts.args else []
        missing = [a for a in names if a not in ns]
        if missing:
            raise UsageError(f"%%parallelize: --args names {', '.join(missing)} are not defined in the notebook; define them first")
        for flag, value in (("--name", opts.name), ("--workbench", opts.workbench)):
            if value is not None and not value.isidentifier():
                raise UsageError(f"%%parallelize: {flag} {value!r} is not a Python identifier")
        if opts.device_memory is not None:
            if not opts.device_memory > 0:
                raise UsageError(f"%%parallelize: --device-memory must be a positive number of GiB, got {opts.device_memory}")
            cluster = dataclasses.replace(cluster, device_memory=opts.device_memory * 2**30)

        batch_argnums = None
        if opts.batch_argnums is not None:
            try:
                batch_argnums = tuple(int(a) for a in opts.batch_argnums.split(","))
            except ValueError:
                raise UsageError(
                    f"%%parallelize: --batch-argnums takes argument positions, e.g. 1 or 1,2; got {opts.batch_argnums!r}"
                ) from None

        previous = ns.get(fn_name, _UNSET)
        result = self.shell.run_cell(cell, store_history=False, silent=True)
        if not result.success:  # the user's error has been shown with their own traceback
            return None
        try:
            step = al.parallelize(
                ns[fn_name],
                cluster=cluster,
                method=opts.method,
                memory_budget=opts.memory_budget,
                microbatches=opts.microbatches,
                schedule=opts.schedule,
                layers=opts.layers,
                max_stages=opts.max_stages,
                cost_model=opts.cost_model,
                remat=opts.remat,
                submesh_space=opts.submesh_space,
                logical_meshes=opts.logical_meshes,
                batch_argnums=batch_argnums,
            )
        except ValueError as err:  # bad option combinations: say which, and keep the old binding
            if previous is _UNSET:
                ns.pop(fn_name, None)
            else:
                ns[fn_name] = previous
            raise UsageError(f"%%parallelize: {err}") from None
        if ray_cluster is not None:
            step.on_ray(ray_cluster)
        ns[fn_name] = step
        self.last_step = step
        if not names:
            return None
        with tqdm(desc="planning", bar_format="{desc} [{elapsed}] {postfix}") as bar:

            def progress(msg: str) -> None:
                bar.set_postfix_str(msg)
                bar.update(1)

            try:
                plan = step.plan(*(ns[a] for a in names), progress=progress)
            except TraceError as err:  # the user's step failed: show their error at their line, not ours
                self._show_user_error(err)
                return None
            except ValueError as err:  # the step cannot be planned as asked: say what to change
                raise UsageError(f"%%parallelize: {err}") from None
        bind = (lambda p: ns.__setitem__(opts.name, p)) if opts.name else None
        if bind:
            bind(plan)
        if opts.no_display:
            return None
        from alpa_lab.notebook.workbench import Workbench

        self.last_workbench = Workbench(plan, step, on_change=bind)
        self.last_workbench.run_args = tuple(ns[a] for a in names)
        if opts.workbench:
            ns[opts.workbench] = self.last_workbench
        return self.last_workbench  # the cell's result: shown, and ``_`` in the next cell

    def _show_user_error(self, err: TraceError) -> None:
        """The exception the user's step raised, with only the user's own frames in its traceback."""
        cause = err.__cause__ if err.__cause__ is not None else err
        frames = []
        tb = cause.__traceback__
        while tb is not None:
            if not _library_file(tb.tb_frame.f_code.co_filename):
                frames.append(tb)
            tb = tb.tb_next
        user_tb = None
        for t in reversed(frames):
            user_tb = types.TracebackType(user_tb, t.tb_frame, t.tb_lasti, t.tb_lineno)
        cause.__cause__ = cause.__context__ = None
        cause.__suppress_context__ = True
        self.shell.showtraceback((type(cause), cause, user_tb), tb_offset=0)
        print(f"%%parallelize: {err}; the step was not planned (fix the cell and run it again)", file=sys.stderr)

    ray_clusters: dict[str, Any] = {}
    """--ray value -> the RayCluster made for it (one local Ray per kernel, reused by later cells)"""

    def _ray_cluster(self, text: str) -> Any:
        known = ParallelizeMagics.ray_clusters.get(text)
        if known is not None and not known._closed:
            return known
        try:
            if text.startswith("local:"):
                hosts, _, per_host = text[len("local:"):].partition("x")
                try:
                    shape = (int(hosts), int(per_host))
                except ValueError:
                    raise UsageError(f"%%parallelize: --ray {text!r}: write local:HOSTSxDEVICES, e.g. local:2x4") from None
                for other in ParallelizeMagics.ray_clusters.values():  # one local Ray per process
                    if other.started_here and not other._closed:
                        other.shutdown()
                cluster = al.RayCluster.local(*shape)
            else:
                cluster = al.RayCluster.connect(text)
        except (al.RayClusterError, ValueError) as err:
            raise UsageError(f"%%parallelize: --ray {text}: {err}") from None
        ParallelizeMagics.ray_clusters[text] = cluster
        return cluster

    @staticmethod
    def _part(ray_cluster: Any, text: str) -> al.ClusterSpec:
        """``--cluster HxD`` beside ``--ray``: that many hosts and devices of the Ray cluster (``ClusterSpec.part``)."""
        kind, _, size = text.rpartition(":")
        try:
            if kind not in ("", "local", "gpu"):
                raise ValueError(f"{kind!r} names other hardware")
            return ray_cluster.spec.part(*(int(x) for x in size.lower().split("x")))
        except (ValueError, TypeError) as exc:
            raise UsageError(
                f"%%parallelize: with --ray, --cluster says which part of the Ray cluster ({ray_cluster.hosts}x"
                f"{ray_cluster.devices_per_host}) to plan for and run on, as HOSTSxDEVICES (e.g. 1x4); got {text!r} ({exc})"
            ) from None

    @staticmethod
    def _cluster(text: str | None) -> al.ClusterSpec:
        if text is None:
            return al.ClusterSpec.default()
        try:
            return al.ClusterSpec.parse(text)
        except al.ClusterError as err:
            raise UsageError(f"%%parallelize: bad --cluster {text!r}: {err}") from None


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext alpa_lab``: registers ``%%parallelize``."""
    ipython.register_magics(ParallelizeMagics)
