"""An ending's traceback lets go of the library's frames (`tracebacks.clear_library_frames`)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import grain_jax_sync as gjs
from grain_jax_sync._src import tracebacks

_PACKAGE = os.path.dirname(gjs.__file__) + os.sep


def _frames(error):
  tb, out = error.__traceback__, []
  while tb is not None:
    out.append((tb.tb_frame, tb.tb_lineno))
    tb = tb.tb_next
  return out


def test_a_source_error_keeps_its_own_frame_and_loses_the_library_frames_locals():
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
  # The iterator's own two frames were still running (skipped); those under them are cleared.
  assert [f.f_code.co_filename for f, _ in library][:2] == [
    os.path.join(_PACKAGE, "_src", "iterator.py")
  ] * 2
  assert all("self" in f.f_locals for f, _ in library[:2])
  cleared = [f for f, _ in library[2:]]
  assert len(cleared) >= 3 and all(dict(f.f_locals) == {} for f in cleared)
  assert all(n > 0 for _, n in library)  # File names and line numbers are kept.
  own = frames[-1][0]
  assert own.f_code.co_name == "source" and own.f_locals["marker"] == "the source's own local"


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
