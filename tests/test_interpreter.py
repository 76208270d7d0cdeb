"""workers.interpreter: the worker process's GIL switch interval and its startup objects
frozen out of full garbage collections (a real worker's log: tests/test_warmup.py)."""

from __future__ import annotations

import gc
import sys

import pytest

from workers.interpreter import apply_switch_interval, freeze_startup_objects


def test_apply_switch_interval_sets_it_and_returns_the_one_before():
    before = sys.getswitchinterval()
    try:
        assert apply_switch_interval(0.5) == pytest.approx(before * 1000)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


def test_freeze_startup_objects_moves_them_out_of_full_collections():
    try:
        kept = [[i] for i in range(1000)]         # tracked containers that live on: frozen too
        frozen = freeze_startup_objects()
        assert frozen == gc.get_freeze_count() and frozen >= len(kept)
        assert len(gc.get_objects(generation=2)) < frozen   # a full collection walks the rest only
    finally:
        gc.unfreeze()
