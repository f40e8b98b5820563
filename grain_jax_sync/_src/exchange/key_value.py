"""Chunks up to process 0, decisions back down, through the key-value store.

The store is the coordination service's (`jax.distributed.initialize`
starts it in process 0). Keys of one stream live under ``ns``,
``{base}/{generation}`` (each (re)start of an iterator its own):

- ``{ns}/s/{p}/{seq // CHUNK_GROUP}/{seq}``: chunk `seq` of process p > 0
  (rows it read, its ending); process 0 reads them with one directory read.
- ``{ns}/d/{seq // GROUP}/{seq}``: decision `seq`, posted by process 0.
  Chunks and decisions are deleted a group at a time once read.
- ``{ns}/ended``: a counter every process increments once after its last
  store call; the one that brings it to the process count deletes ``{ns}``.

Under ``base``, at `close()`: ``{base}/closed/{p}`` (JSON ``[ns, text]``,
read by a peer that waits for p once p's beat shows a new close), and
``{base}/closed_count`` (the last deletes ``{base}``); ``{base}/times/{p}``:
p's `stats()` times (`post_times`). Beats: ``{KEY_ROOT}/beat/{p}`` (`liveness`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from grain_jax_sync._src import periods
from grain_jax_sync._src.exchange.streams import KEY_ROOT, beat_streams, count_close

logger = logging.getLogger(__name__)

# Decisions are keyed in groups of this many, deleted a group per store call.
GROUP = 16
# Chunks in smaller groups: the decider's directory read returns those of a
# group already read again until the group goes.
CHUNK_GROUP = 4


class Cancelled(Exception):
  """The exchange was cancelled by `close()` while waiting for peers."""


def distributed_client() -> Any | None:
  """The `jax.distributed` key-value store client, or None."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - very old or very new JAX.
    return None
  return getattr(distributed.global_state, "client", None)


def _is_not_found(e: Exception) -> bool:
  text = str(e).lower()
  return "not_found" in text or "not found" in text


def _not_posted(e: Exception) -> bool:
  """A blocking read that found nothing within its slice."""
  text = str(e).lower()
  return "deadline" in text or "timed out" in text or "timeout" in text or _is_not_found(e)


def _logged(e: Exception) -> bool:
  """A best-effort write or delete: its failure is only logged."""
  logger.debug("grain_jax_sync: a best-effort store call failed: %s", e)
  return True


class KeyValueExchange:
  """Chunks up to process 0, decisions back down, through the key-value store `client`
  (`jax.distributed`'s, or one with its methods), under the stream's `namespace`."""

  def __init__(self, client: Any, namespace: str, *, process_index: int, process_count: int):
    self.client = client  # The liveness beat writes through it too (`liveness.Beat`).
    self.namespace = namespace
    self.process_index = process_index
    self.process_count = process_count
    self._cancel = threading.Event()
    self._ended = False
    self._chunks_posted = 0
    self._next = [0] * process_count  # Decider: next chunk seq per process.
    self._chunks_deleted = 0  # Groups.
    self._decisions_deleted = 0  # Groups.
    self.ops = 0  # Store calls made (for the scale benchmark).
    self.busy_s = 0.0  # Seconds in store calls and waits (`stats()`'s exchange_s).

  def _call(
    self, doing: str, fn: Any, *args: Any, absent: Callable[[Exception], bool] | None = None
  ) -> Any:
    """One store call, counted and timed; an error for which `absent` holds reads as None."""
    self.ops += 1
    t0 = time.monotonic()
    try:
      return fn(*args)
    except Exception as e:  # noqa: BLE001 - the client raises JaxRuntimeError.
      if absent is not None and absent(e):
        return None
      raise RuntimeError(
        f"the jax.distributed key-value store failed while {doing}: {e}. The"
        " coordination service runs in process 0: if process 0 died, every other"
        " process has lost it and the job must be restarted; otherwise see"
        " process 0's log"
      ) from e
    finally:
      self.busy_s += time.monotonic() - t0

  def _delete(self, key: str) -> None:
    self._call(f"deleting {key}", self.client.key_value_delete, key, absent=_logged)

  def check(self) -> None:
    """Raises `Cancelled` once the iterator is closed (`cancel`)."""
    if self._cancel.is_set():
      raise Cancelled()

  def post_chunk(self, payload: str, *, final: bool = False) -> int:
    """Posts this process's next chunk; its sequence number. A `final` one (an ending) even after `cancel()`."""
    if not final:
      self.check()
    seq = self._chunks_posted
    key = f"{self.namespace}/s/{self.process_index}/{seq // CHUNK_GROUP}/{seq}"
    self._call(f"posting chunk {seq}", self.client.key_value_set, key, payload)
    self._chunks_posted += 1
    return seq

  def delete_chunks(self, below: int) -> None:
    """Deletes own chunks below `below` that the decider has read (whole groups)."""
    while (self._chunks_deleted + 1) * CHUNK_GROUP <= below:
      self._delete(f"{self.namespace}/s/{self.process_index}/{self._chunks_deleted}")
      self._chunks_deleted += 1

  def read_chunks(self) -> list[tuple[int, str]]:
    """New chunks of every peer, in order per process (one directory read)."""
    self.check()
    prefix = f"{self.namespace}/s/"
    entries = self._call("reading the peers' chunks", self.client.key_value_dir_get, prefix)
    # Each process's next keys looked up, not every key parsed (most were read already).
    found = dict(entries)
    out = []
    nxt = self._next
    for p in range(1, self.process_count):  # Process 0 posts no chunk.
      seq = nxt[p]
      while (value := found.get(f"{prefix}{p}/{seq // CHUNK_GROUP}/{seq}")) is not None:
        out.append((p, value))
        seq += 1
      nxt[p] = seq
    return out

  def wait_chunk(
    self, process: int, wait_s: float = periods.LIVENESS_PERIOD_S
  ) -> list[tuple[int, str]]:
    """Blocks up to `wait_s` for `process`'s next chunk, then reads every new one."""
    seq = self._next[process]
    key = f"{self.namespace}/s/{process}/{seq // CHUNK_GROUP}/{seq}"
    value = self._blocking_get(key, f"waiting for process {process}", wait_s)
    if value is None:
      return []
    if self.process_count > 2:
      return self.read_chunks()
    self._next[process] = seq + 1
    return [(process, value)]

  def post_decision(self, seq: int, payload: str, *, final: bool = False) -> None:
    if not final:
      self.check()
    key = f"{self.namespace}/d/{seq // GROUP}/{seq}"
    self._call(f"posting decision {seq}", self.client.key_value_set, key, payload)

  def delete_decisions(self, below: int) -> None:
    """Deletes decisions below `below` (every process has read them), whole groups."""
    while (self._decisions_deleted + 1) * GROUP <= below:
      self._delete(f"{self.namespace}/d/{self._decisions_deleted}")
      self._decisions_deleted += 1

  def try_decision(self, seq: int) -> str | None:
    """Decision `seq` if it is posted, without waiting."""
    self.check()
    key = f"{self.namespace}/d/{seq // GROUP}/{seq}"
    get = self.client.key_value_try_get
    return self._call(f"reading decision {seq}", get, key, absent=_is_not_found)

  def wait_decision(self, seq: int, wait_s: float = periods.LIVENESS_PERIOD_S) -> str | None:
    """Decision `seq`, waiting up to `wait_s` for it."""
    key = f"{self.namespace}/d/{seq // GROUP}/{seq}"
    return self._blocking_get(key, "waiting for process 0's decision", wait_s)

  def _blocking_get(self, key: str, doing: str, wait_s: float) -> str | None:
    self.check()  # Each wait: `Cancelled` once closed.
    get, ms = self.client.blocking_key_value_get, max(1, int(wait_s * 1000))
    return self._call(doing, get, key, ms, absent=_not_posted)

  def _end_key(self, what: str) -> str:
    """A key of this stream's end, under the iterator's prefix: it outlives `end()`."""
    base, generation = self.namespace.rsplit("/", 1)
    return f"{base}/{what}/{generation}"

  def post_reached_end(self) -> None:
    """Records that this process's consumer received every batch; the last sets ``all_at_end``."""
    key = f"{self._end_key('end')}/{self.process_index}"
    self._call("posting the end", self.client.key_value_set, key, "", True)
    count = self._call(
      "counting the end", self.client.key_value_increment, self._end_key("end_count"), 1
    )
    if count == self.process_count:
      self._call("posting the end", self.client.key_value_set, self._end_key("all_at_end"), "1")

  def post_left(self, message: str) -> None:
    """Records that this process left the stream before its end (a close, a restart)."""
    key = f"{self._end_key('end')}/{self.process_index}"
    self._call("posting this host's end", self.client.key_value_set, key, message, True)

  def wait_all_reached_end(self, wait_s: float = periods.LIVENESS_PERIOD_S) -> bool:
    """Whether every process reached the end, waiting up to `wait_s`."""
    key = self._end_key("all_at_end")
    return self._blocking_get(key, "waiting for the end", wait_s) is not None

  def end_notes(self) -> dict[int, str]:
    """Per process that got there or left: "" (reached the end) or why it left."""
    prefix = f"{self._end_key('end')}/"
    entries = self._call("reading the end", self.client.key_value_dir_get, prefix)
    return {int(key[len(prefix) :]): value for key, value in entries}

  def closed_note(self, process: int) -> str | None:
    """What `process` wrote when it closed this iterator (`register_close`), or None."""
    key = closed_key(self.namespace.rsplit("/", 1)[0], process)
    # Best effort, as `beat_of`: None if not posted yet or the store is gone.
    return self._call("reading a close", self.client.key_value_try_get, key, absent=lambda _: True)

  def beat_of(self, process: int) -> str | None:
    """The last beat `process` wrote, or None if it never beat."""
    key = beat_key(process)
    return self._call("reading a beat", self.client.key_value_try_get, key, absent=lambda _: True)

  def sibling(self, namespace: str) -> KeyValueExchange:
    """The exchange of another stream, through the same client."""
    return KeyValueExchange(
      self.client, namespace, process_index=self.process_index, process_count=self.process_count
    )

  def cancel(self) -> None:
    """Stops waits (raising `Cancelled` in the waiting thread)."""
    self._cancel.set()

  def end(self) -> None:
    """Counts this process out after its last store call; the last one deletes the namespace. Once."""
    if self._ended:
      return
    self._ended = True
    try:
      self.ops += 1
      ended = self.client.key_value_increment(f"{self.namespace}/ended", 1)
    except Exception as e:  # noqa: BLE001 - best effort (a dead coordinator).
      logger.debug("grain_jax_sync: could not count the end of %s: %s", self.namespace, e)
      return
    if ended == self.process_count:
      self._delete(self.namespace)


def closed_key(base: str, process: int) -> str:
  """The key `process` writes when it closes the iterator of key prefix `base`."""
  return f"{base}/closed/{process}"


def close_note(stream: str | None, process: int, at_batch: int) -> str:
  """What `process` writes when it closes its iterator in `stream` after `at_batch` batches."""
  return json.dumps([stream, f"process {process} closed its iterator at batch {at_batch}"])


def register_close(base: str, note: str) -> None:
  """Records that this process closed the iterator of key prefix `base`; best effort. The last
  to close it deletes ``{base}``, with the keys of streams some never ended."""

  def close(client: Any, jax: Any) -> None:
    client.key_value_set(closed_key(base, jax.process_index()), note)
    count_close()  # After the note: a peer that sees the count finds it.
    if client.key_value_increment(f"{base}/closed_count", 1) == jax.process_count():
      client.key_value_delete(base)

  _shared_store("record the close", base, close)


def _shared_store(
  doing: str, base: str, call: Callable[[Any, Any], Any], default: Any = None
) -> Any:
  """``call(client, jax)`` where several processes share the store; best effort (a dead
  coordinator, at exit): a failure is logged as "could not {doing} of {base}", `default` returned.
  """
  import jax  # pylint: disable=g-import-not-at-top

  client = distributed_client()
  if client is None or jax.process_count() == 1:
    return default
  try:
    return call(client, jax)
  except Exception as e:  # noqa: BLE001 - best effort.
    logger.debug("grain_jax_sync: could not %s of %s: %s", doing, base, e)
    return default


def post_times(base: str, text: str) -> None:
  """Posts this process's figures at the end of a stream of the iterator `base`; best effort."""
  post = lambda c, jax: c.key_value_set(f"{base}/times/{jax.process_index()}", text, True)  # noqa: E731
  _shared_store("post the figures", base, post)


def read_times(base: str) -> list[tuple[int, str]]:
  """Every process's figures posted under `base` (`post_times`): one directory read; best effort."""
  get = lambda c, _: c.key_value_dir_get(f"{base}/times/")  # noqa: E731
  entries = _shared_store("read the figures", base, get, [])
  by_process = ((key.rsplit("/", 1)[-1], value) for key, value in entries)
  return [(int(p), value) for p, value in by_process if p.isdigit()]


def beat_text(n: int) -> str:
  """This process's `n`-th beat: ``{n}/{closes}`` (`liveness.Liveness.closed`), the streams it waits on."""
  closes, waiting = beat_streams()
  return " ".join([f"{n}/{closes}", *waiting])


def beat_key(process: int) -> str:
  """The key of `process`'s liveness beat (one per process, not per iterator)."""
  return f"{KEY_ROOT}/beat/{process}"
