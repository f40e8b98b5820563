"""An ending's traceback lets go of the library's frames (`tracebacks`): their locals, and the frames."""

from __future__ import annotations

import os
import re
import traceback

import numpy as np
import pytest

import grain_jax_sync as gjs
from grain_jax_sync import testing
from grain_jax_sync._src import tracebacks

_PACKAGE = os.path.dirname(gjs.__file__) + os.sep
_LIBRARY = os.path.join(_PACKAGE, "_src") + os.sep


def _frames(error):
  tb, out = error.__traceback__, []
  while tb is not None:
    out.append((tb.tb_frame, tb.tb_lineno))
    tb = tb.tb_next
  return out


def test_a_source_error_keeps_its_own_frame_and_the_iterators_next_only():
  def source():
    marker = "the source's own local"
    for b in range(3):
      if b == 2:
        raise KeyError(marker)
      yield {"x": np.full(8, b, np.int32)}

  it = gjs.iter_jax_batches(source(), batch_size=8, prefetch_batches=0)
  got = []
  with pytest.raises(KeyError, match="the source's own local") as info:
    for b in it:
      got.append(int(np.asarray(b["x"])[0]))
  it.close()
  assert got == [0, 1]
  frames = _frames(info.value)
  library = [(f, n) for f, n in frames if f.f_code.co_filename.startswith(_PACKAGE)]
  # Of the library, only the iterator's `__next__` (still running then).
  assert [(f.f_code.co_filename, f.f_code.co_name) for f, _ in library] == [
    (os.path.join(_PACKAGE, "_src", "iterator.py"), "__next__"),
  ]
  assert "self" in library[0][0].f_locals and library[0][1] > 0
  own = frames[-1][0]
  assert own.f_code.co_name == "source" and own.f_locals["marker"] == "the source's own local"


def test_full_tracebacks_keep_the_library_frames_when_asked(monkeypatch):
  monkeypatch.setenv(tracebacks.FULL_ENV, "full")

  def source():
    yield {"x": np.zeros(8, np.int32)}
    raise KeyError("late")

  it = gjs.iter_jax_batches(source(), batch_size=8, prefetch_batches=0)
  with it, pytest.raises(KeyError, match="late") as info:
    list(it)
  names = {os.path.basename(f.f_code.co_filename) for f, _ in _frames(info.value)}
  assert {"iterator.py", "session.py", "reader.py", "base.py"} <= names  # base: the source wrapper.


def _raised_in_the_library():
  from grain_jax_sync._src import batches

  try:
    batches.to_leaf_array(object(), context="column 'x' of batch 0")
  except Exception as e:  # noqa: BLE001 - returned to the test.
    return e
  raise AssertionError("to_leaf_array took an object")


def test_every_error_of_a_chain_is_cleared_and_a_cycle_ends():
  first, second = _raised_in_the_library(), _raised_in_the_library()
  first.__context__, second.__context__ = second, first  # A cycle: the walk must end.
  for e in (first, second):
    assert any(f.f_locals for f, _ in _frames(e) if f.f_code.co_filename.startswith(_PACKAGE))
  tracebacks.clear_library_frames(first)
  for e in (first, second):
    library = [f for f, _ in _frames(e) if f.f_code.co_filename.startswith(_PACKAGE)]
    assert library and all(dict(f.f_locals) == {} for f in library)
  tracebacks.clear_library_frames(None)  # Nothing to clear.


def test_for_user_drops_library_frames_along_the_chain_and_library_only_contexts():
  inner = _raised_in_the_library()  # Raised inside `batches`: only library frames below us.
  try:
    raise ValueError("column 'x' of batch 0 is not an array") from inner
  except ValueError as e:
    outer = e
  assert tracebacks.for_user(outer) is outer
  for e in (outer, inner):
    assert all(not f.f_code.co_filename.startswith(_LIBRARY) for f, _ in _frames(e))
  assert [f.f_code.co_name for f, _ in _frames(inner)] == ["_raised_in_the_library"]
  assert str(outer) == "column 'x' of batch 0 is not an array" and outer.__cause__ is inner
  # An implicit context with no frame of the user's is not shown; one with a frame is.
  bookkeeping, users = RuntimeError("process 1 failed"), RuntimeError("process 1 failed")
  bookkeeping.__context__ = TypeError("a queue's bookkeeping")
  bookkeeping.__context__.__traceback__ = _frames_only_in_the_library()
  users.__context__ = outer
  for e in (bookkeeping, users):
    tracebacks.for_user(e)
  assert (bookkeeping.__suppress_context__, users.__suppress_context__) == (True, False)
  text = "".join(traceback.format_exception(bookkeeping))
  assert "bookkeeping" not in text and text.endswith("RuntimeError: process 1 failed\n")
  assert "During handling" in "".join(traceback.format_exception(users))


def _frames_only_in_the_library():
  from grain_jax_sync._src import batches

  try:
    batches.to_leaf_array(object(), context="column 'x' of batch 0")
  except Exception as e:  # noqa: BLE001 - its traceback, from the library's frame on.
    return e.__traceback__.tb_next
  raise AssertionError("to_leaf_array took an object")


def peer_error(fail_on: int) -> dict:
  """Runs in every process: process `fail_on`'s source raises at batch 2; what each host raised."""
  import jax

  def failing_shard():
    for b in range(5):
      if jax.process_index() == fail_on and b == 2:
        raise KeyError("bad record 2")
      yield {"x": np.full(4, b, np.float32)}

  try:
    with gjs.iter_jax_batches(failing_shard(), batch_size=4) as it:
      for _ in it:
        pass
  except Exception as e:  # noqa: BLE001 - returned to the test.
    return {
      "type": type(e).__name__,
      "message": str(e),
      "traceback": "".join(traceback.format_exception(e)),
    }
  raise AssertionError("no error")


@pytest.mark.multiprocess
def test_an_ending_raised_on_a_peer_shows_the_users_frames_and_the_same_message():
  peer, own = testing.values(
    testing.run_processes(
      peer_error, num_processes=2, devices_per_process=2, kwargs={"fail_on": 1}, timeout_s=120
    )
  )
  assert peer["type"] == "RuntimeError"
  assert peer["message"] == (
    "process 1 failed while reading batch 2 from its source: KeyError: 'bad record 2'"
    " (process 1 raised KeyError; every other process stops too, so that no host waits forever)"
  )
  assert (own["type"], own["message"]) == ("KeyError", "'bad record 2'")
  for raised in (peer, own):
    files = re.findall(r'^  File "([^"]+)", line \d+, in (\w+)$', raised["traceback"], re.M)
    library = [(os.path.basename(f), fn) for f, fn in files if f.startswith(_LIBRARY)]
    assert library == [("iterator.py", "__next__")], raised["traceback"]
    assert files[0][1] == "peer_error" and "During handling" not in raised["traceback"]
  # Only the process whose source raised shows the source's frame, last.
  assert re.findall(r"in (\w+)$", own["traceback"], re.M)[-1] == "failing_shard"
  assert "failing_shard" not in peer["traceback"]
  assert peer["traceback"].endswith(f"RuntimeError: {peer['message']}\n")
