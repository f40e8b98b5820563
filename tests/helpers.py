"""Helpers shared by the test modules of the iterator (test_iterator, test_state, ...)."""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time

import pytest

from grain_jax_sync import testing
from grain_jax_sync._src import messages

MULTI = [pytest.param(2, 4, id="2x4"), pytest.param(4, 2, id="4x2")]
TIMEOUT = 180


def wire(report: messages.Report) -> str:
  """A report as it travels between hosts: inside a chunk."""
  return messages.Chunk(start=0, ack=0, report=report).to_json()


def unwire(text: str) -> messages.Report:
  """The report a host reads from `wire`'s text."""
  return messages.Chunk.from_json(text).report


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


def run_cases(n: int, d: int, cases: dict, timeout_s: float = TIMEOUT) -> list[dict]:
  """`scenarios.run_cases` in one launch of n processes x d devices; per process {case: value}."""
  import scenarios

  return testing.values(
    testing.run_processes(
      scenarios.run_cases,
      num_processes=n,
      devices_per_process=d,
      args=({k: (_by_name(f), a, kw) for k, (f, a, kw) in cases.items()},),
      timeout_s=timeout_s,
    )
  )


def _by_name(fn) -> tuple[str, str, str]:
  """A module-level function as (module, name, the folder that makes the module importable)."""
  root = os.path.dirname(os.path.abspath(inspect.getfile(fn)))
  for _ in range(fn.__module__.count(".")):
    root = os.path.dirname(root)
  return fn.__module__, fn.__qualname__, root


def check_cases(results: list[dict], checks: dict) -> None:
  """Runs ``checks[case](values of every process)`` for each case; fails naming every failed case."""
  assert all(sorted(r) == sorted(checks) for r in results), "every case has its checks"
  check_each(
    {case: functools.partial(check, [r[case] for r in results]) for case, check in checks.items()}
  )


def check_each(checks: dict) -> None:
  """Runs every ``checks[case]()``; fails naming every case that failed, with its message."""
  failed = []
  for case, check in checks.items():
    try:
      check()
    except AssertionError as e:
      failed.append(f"case {case!r}: {e}")
  assert not failed, "\n\n".join(failed)
