"""The interface every source adapter implements."""

from __future__ import annotations

import base64
import contextlib
import contextvars
import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any


class SourceIterator:
  """A per-host batch iterator with optional exact resume (`supports_state`).

  `get_state()` is called in the reading thread right after each `__next__`
  and held beside that batch until the consumer receives it: a snapshot that
  later reads do not change (maybe opaque). `export_state` turns it into JSON
  when the user asks for the state; `set_state` takes that back.
  """

  supports_state: bool = False
  description: str = "source"
  _checked = False  # The first state kept was checked for JSON (`_kept`).
  _it: Any = None  # The iterator it reads, if any: `close` closes it.

  def __iter__(self) -> SourceIterator:
    return self

  def __next__(self) -> Any:
    raise NotImplementedError

  def get_state(self) -> Any:
    raise RuntimeError(
      f"{self.description} cannot report its position, so the iterator"
      " cannot be checkpointed. Use a Grain DataLoader or dataset, a"
      " sequence (list) of batches, or an iterator with get_state() and"
      " set_state()."
    )

  def _kept(self, raw: Any) -> Any:
    """A copy of a wrapped iterator's own state `raw`, checked for JSON at the first batch."""
    state = encode_state(raw)
    if not self._checked:
      check_json(state, self.description)
      self._checked = True
    return state

  def export_state(self, state: Any) -> Any:
    """The JSON form of a snapshot taken by `get_state` (default: itself, checked).

    Checked at each checkpoint: a source whose first state was JSON may return one that is not.
    """
    check_json(state, self.description)
    return state

  def set_state(self, state: Any) -> None:
    del state
    self.get_state()

  def close(self) -> None:
    """Closes the iterator it reads, where that has a `close` (a generator's frees what it holds)."""
    close = getattr(self._it, "close", None)
    if callable(close):
      close()

  def stats(self, state: Any) -> dict[str, Any]:
    """Figures of its own for `stats()` as of a held `state` (default: none)."""
    del state
    return {}

  def fingerprint(self) -> dict[str, str]:
    """What every process's source must share, compared in the first exchange (default: none)."""
    return {}

  def local_iterator(self, owner: Any) -> Any:
    """Its own iterator type seen through `owner` (``local_state``/``restore_local``), or None."""
    del owner
    return None


class WrappedIterator(SourceIterator):
  """A source over another iterator, `_it` (set by subclasses), resumable through its own state."""

  def __next__(self) -> Any:
    return next(self._it)

  def get_state(self) -> Any:
    if not self.supports_state:
      return super().get_state()
    return self._kept(self._it.get_state())  # A copy, never the live state.

  def set_state(self, state: Any) -> None:
    if not self.supports_state:
      super().set_state(state)
      return
    self._it.set_state(decode_state(state))


# Whether the state being exported goes to a file (`exporting_to_files`).
TO_FILES = contextvars.ContextVar("grain_jax_sync_state_to_files", default=False)


@contextlib.contextmanager
def exporting_to_files():
  """Within it, `export_state` writes for a file (no JSON size limit)."""
  token = TO_FILES.set(True)
  try:
    yield
  finally:
    TO_FILES.reset(token)


def encode_state(state: Any) -> Any:
  """A copy of a source state, JSON-serialisable (bytes -> base64).

  A copy: an iterator may return its own live dict, which its next reads
  change; held until the consumer takes the batch, it would skip the read-ahead.
  """
  if isinstance(state, (bytes, bytearray)):
    return {"__bytes_b64__": base64.b64encode(bytes(state)).decode("ascii")}
  return _copy(state)


_ATOMS = (str, int, float, bool, type(None), bytes)


def _copy(x: Any) -> Any:
  """A deep copy of JSON-like values, quick for dicts, lists and scalars."""
  t = type(x)
  if t is dict:
    return {k: v if type(v) in _ATOMS else _copy(v) for k, v in x.items()}
  if t is list:
    return [v if type(v) in _ATOMS else _copy(v) for v in x]
  if t in _ATOMS:
    return x
  return copy.deepcopy(x)


def decode_state(state: Any) -> Any:
  if isinstance(state, dict) and set(state) == {"__bytes_b64__"}:
    return base64.b64decode(state["__bytes_b64__"])
  return state


def check_json(state: Any, description: str) -> None:
  try:
    json.dumps(state)
  except (TypeError, ValueError) as e:
    raise RuntimeError(
      f"the state of {description} is not JSON-serialisable ({e}); wrap the"
      " source so that get_state() returns JSON values"
    ) from e


def drop_dict_paths(element: Any, paths: Sequence[tuple[Any, ...]]) -> Any:
  """`element` (NumPy or traced by tf.data) without the entries at `paths` (nor emptied dicts)."""
  if not paths or not isinstance(element, Mapping):
    return element
  here = {p[0] for p in paths if len(p) == 1}
  deeper: dict[Any, list[tuple[Any, ...]]] = {}
  for p in paths:
    if len(p) > 1:
      deeper.setdefault(p[0], []).append(p[1:])
  out = {}
  for k, v in element.items():
    if k in here:
      continue
    kept = drop_dict_paths(v, deeper.get(k, []))
    if k in deeper and isinstance(kept, Mapping) and not kept:
      continue  # Every column under `k` was dropped.
    out[k] = kept
  return out
