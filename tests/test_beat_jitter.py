"""Jitter formula, cap below the cron period, stability across processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from beat.jitter import effective_window_s, jitter_hash, jitter_offset_s
from beat.schedule import cron_period_s


def formula(tenant: str, task: str, window: int) -> int:
    return int(hashlib.sha256(f"{tenant}:{task}".encode()).hexdigest(), 16) % window


@pytest.mark.parametrize("tenant,task,window", [
    ("acme", "daily-digest", 600),
    ("t0123456789ab", "cron-7", 600),
    ("big.co", "report_1", 120),
    ("a", "b", 7),
    ("tenant-x", "x" * 128, 3600),
    ("acme", "daily-digest", 1),
])
def test_offset_is_sha256_of_tenant_and_task_modulo_window(tenant, task, window):
    assert jitter_hash(tenant, task) == int(hashlib.sha256(f"{tenant}:{task}".encode()).hexdigest(), 16)
    assert jitter_offset_s(tenant, task, window) == formula(tenant, task, window)
    # a period longer than the window changes nothing
    assert jitter_offset_s(tenant, task, window, period_s=window + 1) == formula(tenant, task, window)


@pytest.mark.parametrize("window_s,period_s,expected", [
    (0, 3600, 0),
    (600, None, 600),
    (600, 3600, 600),
    (600, 300, 300),       # */5: capped at the period
    (120, 60, 60),         # every minute
    (600, 600, 600),
    (-5, 100, 0),
])
def test_effective_window(window_s, period_s, expected):
    assert effective_window_s(window_s, period_s) == expected


def test_zero_window_means_no_jitter():
    assert {jitter_offset_s("acme", f"c{i}", 0, 3600) for i in range(50)} == {0}


def test_offsets_are_capped_below_the_cron_period():
    period = cron_period_s("*/5 * * * *")
    assert period == 300
    offsets = [jitter_offset_s("acme", f"job-{i}", 600, period) for i in range(400)]
    assert all(0 <= o < 300 for o in offsets)
    assert offsets == [formula("acme", f"job-{i}", 300) for i in range(400)]
    assert max(offsets) > 250 and min(offsets) < 50          # spread over the capped window


def test_same_offset_in_another_process_with_another_hash_seed():
    code = "from beat.jitter import jitter_offset_s; print(jitter_offset_s('acme', 'digest', 600, 3600))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert outs == {str(formula("acme", "digest", 600))}
