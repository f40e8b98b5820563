"""An in-memory key-value store with the methods of `jax.distributed`'s client.

For the agreement's property test: many simulated processes (threads) share
one store, as many processes share one coordination service. Semantics follow
the real client where the agreement relies on them: `key_value_set` refuses to
overwrite unless told to, a missing key raises an error saying NOT_FOUND, a
blocking read that times out raises DEADLINE_EXCEEDED, deleting a key deletes
everything under it, and `key_value_increment` is atomic.
"""

from __future__ import annotations

import threading


class MemoryStore:
  def __init__(self) -> None:
    self._data: dict[str, str] = {}
    self._cv = threading.Condition()
    self.ops = 0

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    with self._cv:
      self.ops += 1
      if key in self._data and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists")
      self._data[key] = value
      self._cv.notify_all()

  def key_value_try_get(self, key: str) -> str:
    with self._cv:
      self.ops += 1
      if key not in self._data:
        raise RuntimeError(f"NOT_FOUND: key {key} not found")
      return self._data[key]

  def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
    with self._cv:
      self.ops += 1
      if not self._cv.wait_for(lambda: key in self._data, timeout_in_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: timed out waiting for {key}")
      return self._data[key]

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    with self._cv:
      self.ops += 1
      return sorted((k, v) for k, v in self._data.items() if k.startswith(prefix))

  def key_value_delete(self, key: str) -> None:
    with self._cv:
      self.ops += 1
      for k in [k for k in self._data if k == key or k.startswith(key.rstrip("/") + "/")]:
        del self._data[k]

  def key_value_increment(self, key: str, increment: int) -> int:
    with self._cv:
      self.ops += 1
      value = int(self._data.get(key, "0")) + increment
      self._data[key] = str(value)
      return value

  def keys(self) -> list[str]:
    with self._cv:
      return sorted(self._data)
