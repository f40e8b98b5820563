"""An in-memory key-value store with the methods of `jax.distributed`'s client.

Shared by the simulated cluster's hosts and the agreement's tests. Its
semantics follow the real client's where the agreement relies on them (no
overwrite unless told, NOT_FOUND, DEADLINE_EXCEEDED, deletes under a key,
atomic increments).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable


class MemoryStore:
  """The store, safe to share between threads; `ops` counts the calls made.

  Args:
    on_set: Called with each key set (the simulated cluster wakes the tasks parked on it).
    wait: Whether a blocking read of a missing key waits for it. If not (the
      simulated cluster: one thread), it raises at once and `missed` names the
      key, where the scheduler parks the reader.
  """

  def __init__(self, on_set: Callable[[str], None] | None = None, *, wait: bool = True):
    self._data: dict[str, str] = {}
    self._keys: list[str] = []  # Sorted: a directory is one slice.
    self._cv = threading.Condition()
    self._on_set = on_set
    self._wait = wait
    self.ops = 0
    self.missed: str | None = None

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    with self._cv:
      self.ops += 1
      if key in self._data and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
      self._put(key, value)

  def _put(self, key: str, value: str) -> None:
    if key not in self._data:
      bisect.insort(self._keys, key)
    self._data[key] = value
    self._cv.notify_all()
    if self._on_set is not None:
      self._on_set(key)

  def _under(self, prefix: str) -> tuple[int, int]:
    start = bisect.bisect_left(self._keys, prefix)
    return start, bisect.bisect_left(self._keys, prefix + "\U0010ffff", start)

  def key_value_try_get(self, key: str) -> str:
    with self._cv:
      self.ops += 1
      if key not in self._data:
        raise RuntimeError(f"NOT_FOUND: key {key} not found")
      return self._data[key]

  def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
    with self._cv:
      self.ops += 1
      found = key in self._data or (
        self._wait and self._cv.wait_for(lambda: key in self._data, timeout_in_ms / 1000)
      )
      if not found:
        self.missed = key
        raise RuntimeError(f"DEADLINE_EXCEEDED: timed out waiting for {key}")
      return self._data[key]

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    with self._cv:
      self.ops += 1
      start, stop = self._under(prefix)
      return [(k, self._data[k]) for k in self._keys[start:stop]]

  def key_value_delete(self, key: str) -> None:
    """Deletes `key` and every key under ``key/``."""
    with self._cv:
      self.ops += 1
      start, stop = self._under(key.rstrip("/") + "/")
      for k in self._keys[start:stop]:
        del self._data[k]
      del self._keys[start:stop]
      if self._data.pop(key, None) is not None:
        del self._keys[bisect.bisect_left(self._keys, key)]

  def key_value_increment(self, key: str, increment: int) -> int:
    with self._cv:
      self.ops += 1
      value = int(self._data.get(key, "0")) + increment
      self._put(key, str(value))
      return value

  def keys(self) -> list[str]:
    """Every key, sorted."""
    with self._cv:
      return list(self._keys)
