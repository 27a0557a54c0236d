"""``quiet_gc``: the collector's settings are restored after tracing and planning, whatever happens inside."""

from __future__ import annotations

import gc
import weakref

import pytest

from alpa_lab._gc import THRESHOLDS, quiet_gc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_settings_restored_after_nesting_and_errors():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with quiet_gc():
        assert gc.get_threshold() == THRESHOLDS
        assert gc.get_freeze_count() >= frozen
        with quiet_gc():  # nested (planning traces): the outer one restores
            pass
        assert gc.get_threshold() == THRESHOLDS
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
    with pytest.raises(RuntimeError):
        with quiet_gc():
            raise RuntimeError("a failed plan")
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen


def test_cycles_made_inside_are_still_collected():
    with quiet_gc():
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        del a, b
        gc.collect()
        assert ref() is None


def test_planning_leaves_the_collector_as_it_was():
    import alpa_lab as al
    from alpa_lab.models import make_mlp

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    ex = make_mlp()
    step = al.parallelize(ex.train_step, cluster=al.ClusterSpec.local(1, 2))
    step.plan(*ex.args)
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen


def test_a_host_that_froze_objects_keeps_them_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with quiet_gc():
            assert gc.get_threshold() == THRESHOLDS
        # still frozen (``gc.unfreeze`` would leave 0; a few frozen objects may die meanwhile)
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()
