"""The options, checked under their public names; resume states checked.

Malformed or foreign states are refused, naming the field, before the source moves.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import scenarios

import grain_jax_sync as gjs


class Recorder:
  """A resumable source that records whether it was moved."""

  def __init__(self):
    self._batches = scenarios.make_batches(0, [8] * 4)
    self.i = 0
    self.moved = False

  def __iter__(self):
    return self

  def __next__(self):
    if self.i >= len(self._batches):
      raise StopIteration
    self.i += 1
    return self._batches[self.i - 1]

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    i = int(state["i"])  # Validates (KeyError) before moving.
    self.moved = True
    self.i = i


def _fresh(batch_size=8, source=None):
  return gjs.iter_jax_batches(source or Recorder(), batch_size=batch_size)


def _state(**changes):
  it = _fresh()
  next(it)
  state = it.get_state()
  it.close()
  state.update(changes)
  return state


@pytest.mark.parametrize(
  ("state", "needle"),
  [
    ("not a dict", "`state` must be a dict from JaxBatchIterator.get_state(), got a str"),
    ({"version": 1}, "`state` has no 'batches' field"),
    (_state(version=99), "`state['version']` is 99"),
    (_state(batches="three"), "`state['batches']` must be an int >= 0, got 'three'"),
    (_state(batches=True), "`state['batches']` must be an int >= 0, got True"),
    (
      _state(source={}),
      "`state['source']` is not a state of an iterator of type Recorder: KeyError",
    ),
    (_state(process_count=2), "`state` was taken with process_count=2"),
    (_state(settings="x"), "`state['settings']` must be a dict"),
  ],
)
def test_malformed_state_raises_naming_the_field_before_the_source_moves(state, needle):
  source = Recorder()
  it = _fresh(source=source)
  with pytest.raises(ValueError) as e:
    it.set_state(state)
  assert str(e.value).startswith("process 0: ") and needle in str(e.value)
  assert not source.moved and source.i == 0
  # The error is this host's ending: iterating raises it (and would tell peers).
  with pytest.raises(ValueError, match="process 0: "):
    next(it)
  it.close()


def test_state_from_other_settings_is_refused():
  state = _state()
  it = _fresh(batch_size=16)
  with pytest.raises(ValueError, match=r"other settings \(batch_size: 8 vs 16, saved vs now\)"):
    it.set_state(state)
  it.close()


def test_state_records_the_settings_and_resumes():
  state = _state()
  assert state["version"] == 2 and state["settings"]["batch_size"] == 8
  source = Recorder()
  it = _fresh(source=source)
  it.set_state(state)
  assert source.moved
  np.testing.assert_array_equal(np.asarray(next(it)["x"]), scenarios.rows_for(0, 1, 8))
  it.close()


def test_a_state_saved_before_resumes():
  # As `get_state()` saved it, written out: its settings are keyed by the
  # public option names, so a state saved by an earlier run still resumes.
  saved = {
    "version": 2,
    "batches": 1,
    "process_index": 0,
    "process_count": 1,
    "settings": {
      "batch_size": 8,
      "drop_last": False,
      "dtypes": None,
      "mask_key": None,
      "paddings": None,
      "synchronize_lookahead": 10,
    },
    "source": {"i": 1},
  }
  # Saved so today, but for the window of the former default, which a state
  # no longer carries (how far ahead hosts decide never changes the stream).
  today = {**saved, "settings": {**saved["settings"]}}
  del today["settings"]["synchronize_lookahead"]
  assert _state() == today
  source = Recorder()
  it = _fresh(source=source)
  it.set_state(saved)
  np.testing.assert_array_equal(np.asarray(next(it)["x"]), scenarios.rows_for(0, 1, 8))
  it.close()


@pytest.mark.parametrize(
  ("keywords", "needle"),
  [
    ({"batch_size": 0}, "`batch_size` must be a positive int or None, got 0"),
    ({"synchronize_lookahead": 0}, "`synchronize_lookahead` must be a positive int or None, got 0"),
    ({"prefetch_batches": -1}, "`prefetch_batches` must be an int >= 0, got -1"),
    ({"sync_timeout_s": 0}, "`sync_timeout_s` must be a finite number of seconds > 0, got 0"),
    ({"mask_key": 3}, "`mask_key` must be a str or None, got 3"),
    ({"shape_buckets": {"x": [4]}}, "`shape_buckets` needs `pad_shapes`"),
  ],
)
def test_iter_jax_batches_checks_each_option_naming_it(keywords, needle):
  with pytest.raises(ValueError, match=re.escape(needle)):
    gjs.iter_jax_batches([], **keywords)


@pytest.mark.parametrize("name", ["prefetch", "read_ahead", "process_count"])
def test_an_unknown_keyword_raises_as_python_words_it(name):
  with pytest.raises(
    TypeError, match=rf"iter_jax_batches\(\) got an unexpected keyword argument '{name}'"
  ):
    gjs.iter_jax_batches([], **{name: 1})
