"""Stopping a child server process (the embedded Redis, the upstream simulator)."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM ``process``, SIGKILL it if it is still there after ``timeout_s``; reap it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
