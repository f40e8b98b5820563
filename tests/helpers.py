"""Helpers shared by the test modules of the iterator (test_iterator, test_state, ...)."""

from __future__ import annotations

import threading
import time

import pytest

from grain_jax_sync import testing

MULTI = [pytest.param(2, 4, id="2x4"), pytest.param(4, 2, id="4x2")]
TIMEOUT = 180


def wait_for_no_threads(deadline_s=10.0):
  end = time.monotonic() + deadline_s

  def names():
    return [t.name for t in threading.enumerate() if t.name.startswith("grain_jax_sync-")]

  while names() and time.monotonic() < end:
    time.sleep(0.01)
  return names()


def run(fn, n, d, *args, **kwargs):
  return testing.run_processes(
    fn, num_processes=n, devices_per_process=d, args=args, kwargs=kwargs, timeout_s=TIMEOUT
  )
