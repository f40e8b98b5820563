"""Moves window reports between processes. Knows nothing about batches.

Three transports, one interface (`Exchange.all_gather`):

* `LocalExchange`: one process, or synchronization off. Returns the caller's
  own payload; no communication.
* `KeyValueExchange`: the coordination service's key-value store that
  `jax.distributed.initialize` starts. No device work, no host-device sync, so
  it can run in a background thread ahead of the training step. Two ways to
  use it:

  - windowed (`all_gather`): per window each process makes one write, one
    directory read (plus one blocking read per wait while peers are behind)
    and one delete;
  - pipelined (`post` / `poll` / `wait` / `release`): each process posts a
    chunk whenever it has read new batches, reads every peer's new chunks with
    one directory read, blocks on one peer's next key only when it has nothing
    else to do, and deletes its own chunks once every peer has acknowledged
    them.

  Either way: O(1) messages per process per window (chunk), O(processes) per
  window at the coordinator; a directory read returns O(processes) chunks.
  `finish` ends with one barrier and one directory delete.
* `CollectiveExchange`: `process_allgather` over the devices; the fallback when
  there are several processes but no key-value store client.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_KEY_ROOT = "grain_jax_sync"
_instances = itertools.count()


class Cancelled(Exception):
  """The exchange was cancelled by `close()` while waiting for peers."""


class PeerTimeoutError(RuntimeError):
  """Peers did not report within the exchange timeout.

  Attributes:
    missing: Indices of the processes whose reports never arrived.
  """

  def __init__(self, message: str, missing: Sequence[int]):
    super().__init__(message)
    self.missing = tuple(missing)


class Exchange(Protocol):
  process_index: int
  process_count: int

  def all_gather(self, window: int, payload: str) -> list[str]:
    """Returns every process's payload for `window`, in process order."""
    ...

  def finish(self) -> None:
    """Called once by every process after the final window; cleans up."""
    ...

  def close(self) -> None:
    """Releases what this process can release without its peers."""
    ...


class LocalExchange:
  """No communication: each process decides alone."""

  def __init__(self, process_index: int = 0):
    self.process_index = process_index
    self.process_count = 1

  def all_gather(self, window: int, payload: str) -> list[str]:
    del window
    return [payload]

  def finish(self) -> None:
    pass

  def close(self) -> None:
    pass


def distributed_client() -> Any | None:
  """The `jax.distributed` key-value store client, or None."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - very old or very new JAX.
    return None
  return getattr(distributed.global_state, "client", None)


def new_namespace(name: str | None = None) -> str:
  """A key prefix for one iterator; the same on every process under SPMD.

  Every process creates its iterators in the same order, so a per-process
  counter names them consistently. Pass `name` where that does not hold (an
  iterator created on some processes only).
  """
  return f"{_KEY_ROOT}/{name if name is not None else next(_instances)}"


class KeyValueExchange:
  """All-gather through the coordination service's key-value store.

  Windowed keys: ``{namespace}/{window}/{process}``. A process deletes its key
  for window w once it holds every report of window w+1, because by then every
  peer has read window w.

  Pipelined keys: ``{namespace}/s/{process}/{seq}``, one per posted chunk. The
  caller releases a chunk once every peer has acknowledged it.

  `finish` waits at a barrier; then process 0 deletes the namespace.
  """

  def __init__(
    self,
    client: Any,
    namespace: str,
    *,
    process_index: int,
    process_count: int,
    timeout_s: float,
    poll_s: float = 0.5,
  ):
    if timeout_s <= 0:
      raise ValueError(f"`sync_timeout_s` must be > 0, got {timeout_s}")
    self._client = client
    self._ns = namespace
    self.process_index = process_index
    self.process_count = process_count
    self._timeout_s = float(timeout_s)
    self._poll_ms = max(1, int(poll_s * 1000))
    self._cancel = threading.Event()
    # Held while writing a key, so that no write lands after `close()`.
    self._write_lock = threading.Lock()
    self._released = False  # `finish()` or `close()` has dealt with the keys.
    self._own_keys: list[str] = []
    # Pipelined use.
    self._posted = 0
    self._unreleased: collections.deque[int] = collections.deque()
    self._next = [0] * process_count
    self._inbox: list[dict[int, str]] = [{} for _ in range(process_count)]

  def _key(self, window: int, process: int) -> str:
    return f"{self._ns}/{window}/{process}"

  def all_gather(self, window: int, payload: str) -> list[str]:
    key = self._key(window, self.process_index)
    with self._write_lock:
      if self._cancel.is_set():
        raise Cancelled()
      try:
        self._client.key_value_set(key, payload)
      except Exception as e:  # noqa: BLE001 - the client raises JaxRuntimeError.
        raise _store_failed(e, f"posting window {window}") from e
      self._own_keys.append(key)
    prefix = f"{self._ns}/{window}/"
    deadline = time.monotonic() + self._timeout_s
    got: dict[int, str] = {}
    while True:
      try:
        entries = self._client.key_value_dir_get(prefix)
      except Exception as e:  # noqa: BLE001 - the client raises JaxRuntimeError.
        raise _store_failed(e, f"reading window {window}") from e
      for k, v in entries:
        got[int(k.rsplit("/", 1)[1])] = v
      missing = [p for p in range(self.process_count) if p not in got]
      if not missing:
        break
      if self._cancel.is_set():
        raise Cancelled()
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        raise self.timeout_error(missing, f"window {window}")
      wait_ms = max(1, min(self._poll_ms, int(remaining * 1000)))
      try:
        v = self._client.blocking_key_value_get(self._key(window, missing[0]), wait_ms)
        got[missing[0]] = v
      except Exception as e:  # noqa: BLE001 - the client raises XlaRuntimeError.
        if not _is_deadline(e):
          raise _store_failed(e, f"waiting for {_processes(missing)} (window {window})") from e
    # Every peer has posted window `window`, so all have read `window - 1`.
    while len(self._own_keys) > 1:
      self._delete(self._own_keys.pop(0))
    return [got[p] for p in range(self.process_count)]

  def _delete(self, key: str) -> None:
    try:
      self._client.key_value_delete(key)
    except Exception as e:  # noqa: BLE001 - best effort.
      logger.debug("could not delete %s: %s", key, e)

  # -- pipelined use -----------------------------------------------------------

  def _stream_prefix(self) -> str:
    return f"{self._ns}/s/"

  def post(self, payload: str) -> int:
    """Publishes this process's next chunk; returns its sequence number."""
    seq = self._posted
    with self._write_lock:
      if self._cancel.is_set():
        raise Cancelled()
      try:
        self._client.key_value_set(f"{self._stream_prefix()}{self.process_index}/{seq}", payload)
      except Exception as e:  # noqa: BLE001 - the client raises JaxRuntimeError.
        raise _store_failed(e, f"posting chunk {seq}") from e
    self._posted += 1
    self._unreleased.append(seq)
    return seq

  def poll(self) -> list[tuple[int, str]]:
    """Peers' chunks not returned before, in order per process (one dir read)."""
    if self._cancel.is_set():
      raise Cancelled()
    prefix = self._stream_prefix()
    try:
      entries = self._client.key_value_dir_get(prefix)
    except Exception as e:  # noqa: BLE001 - the client raises JaxRuntimeError.
      raise _store_failed(e, "reading the peers' chunks") from e
    for key, value in entries:
      p_text, _, seq_text = key[len(prefix) :].partition("/")
      p, seq = int(p_text), int(seq_text)
      if p != self.process_index and seq >= self._next[p]:
        self._inbox[p][seq] = value
    return self._drain()

  def _drain(self) -> list[tuple[int, str]]:
    out = []
    for p, box in enumerate(self._inbox):
      while self._next[p] in box:
        out.append((p, box.pop(self._next[p])))
        self._next[p] += 1
    return out

  def wait(self, process: int, timeout_s: float) -> list[tuple[int, str]]:
    """Blocks until `process` posts its next chunk or `timeout_s` passes.

    Returns:
      The chunks that arrived (possibly none on a timeout).

    Raises:
      Cancelled: If `close()` was called.
      RuntimeError: If the key-value store fails.
    """
    if self._cancel.is_set():
      raise Cancelled()
    key = f"{self._stream_prefix()}{process}/{self._next[process]}"
    wait_ms = max(1, min(self._poll_ms, int(timeout_s * 1000)))
    try:
      value = self._client.blocking_key_value_get(key, wait_ms)
    except Exception as e:  # noqa: BLE001 - the client raises XlaRuntimeError.
      if not _is_deadline(e):
        raise _store_failed(e, f"waiting for process {process}") from e
      return []
    self._inbox[process][self._next[process]] = value
    return self._drain()

  def release(self, below: int) -> None:
    """Deletes this process's chunks with sequence numbers below `below`."""
    while self._unreleased and self._unreleased[0] < below:
      seq = self._unreleased.popleft()
      self._delete(f"{self._stream_prefix()}{self.process_index}/{seq}")

  def timeout_error(self, missing: Sequence[int], what: str) -> PeerTimeoutError:
    """The error for peers that did not report `what` in time."""
    return PeerTimeoutError(
      f"{_processes(missing)} did not report {what} within"
      f" `sync_timeout_s`={self._timeout_s:g}s; {_pronoun(missing)} may"
      " have died, hung in its source, or created its iterators in a"
      " different order (pass the same `name=` on every process).",
      missing,
    )

  @property
  def timeout_s(self) -> float:
    return self._timeout_s

  # -- both --------------------------------------------------------------------

  def finish(self) -> None:
    """Barrier, then process 0 deletes the whole namespace in one call."""
    timeout_ms = int(min(self._timeout_s, 60.0) * 1000)
    try:
      self._client.wait_at_barrier(f"{self._ns}/end", timeout_ms)
    except Exception as e:  # noqa: BLE001
      logger.warning("grain_jax_sync: end-of-stream barrier failed: %s", e)
      return
    # Every process is past its last read, so nothing under the namespace is
    # needed any more; deleting a key deletes everything below it.
    if self.process_index == 0:
      self._delete(self._ns)
    self._own_keys.clear()
    self._unreleased.clear()
    self._released = True

  def close(self) -> None:
    """Stops waits and writes; the last process to close deletes the keys.

    Never blocks on peers (it runs in `close()` and in garbage collection):
    each process adds one to a counter under the namespace, and the one that
    brings it to the process count deletes the namespace, because by then no
    process writes or needs its keys. A process that never closes (it died)
    leaves them behind.
    """
    self._cancel.set()
    with self._write_lock:
      if self._released:
        return
      self._released = True
      try:
        closed = self._client.key_value_increment(f"{self._ns}/closed", 1)
      except Exception as e:  # noqa: BLE001 - best effort (a dead coordinator).
        logger.debug("grain_jax_sync: could not count the close of %s: %s", self._ns, e)
        return
    if closed >= self.process_count:
      self._delete(self._ns)

  @property
  def own_keys(self) -> tuple[str, ...]:
    return tuple(self._own_keys)


def _store_failed(e: Exception, doing: str) -> RuntimeError:
  """The error for a key-value store call that failed outright."""
  return RuntimeError(
    f"the jax.distributed key-value store failed while {doing}: {e}. The"
    " coordination service runs in process 0: if process 0 died, every other"
    " process has lost it and the job must be restarted; otherwise see"
    " process 0's log"
  )


def _is_deadline(e: Exception) -> bool:
  text = str(e).lower()
  return "deadline" in text or "timed out" in text or "timeout" in text


def _processes(ps: Sequence[int]) -> str:
  return ("process " if len(ps) == 1 else "processes ") + ", ".join(map(str, ps))


def _pronoun(ps: Sequence[int]) -> str:
  return "it" if len(ps) == 1 else "they"


class CollectiveExchange:
  """All-gather of JSON payloads with `process_allgather` (device fallback).

  Two collectives per window: the payload lengths, then the padded payloads.
  It must run in the same order on every process, relative to all other
  collectives, so prefer `KeyValueExchange`.
  """

  def __init__(self, *, process_index: int, process_count: int):
    self.process_index = process_index
    self.process_count = process_count

  def all_gather(self, window: int, payload: str) -> list[str]:
    del window
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    data = np.frombuffer(payload.encode(), dtype=np.uint8)
    lengths = np.asarray(
      multihost_utils.process_allgather(np.array([data.size], np.int32))
    ).reshape(-1)
    width = int(lengths.max())
    buf = np.zeros((width,), np.uint8)
    buf[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(buf)).reshape(self.process_count, width)
    return [bytes(gathered[p, : lengths[p]]).decode() for p in range(self.process_count)]

  def finish(self) -> None:
    pass

  def close(self) -> None:
    pass


def make_exchange(*, synchronize: bool, name: str | None, timeout_s: float) -> Exchange:
  """Picks the transport for this process."""
  import jax  # pylint: disable=g-import-not-at-top

  index, count = jax.process_index(), jax.process_count()
  if count == 1 or not synchronize:
    return LocalExchange(index)
  client = distributed_client()
  if client is not None:
    return KeyValueExchange(
      client,
      new_namespace(name),
      process_index=index,
      process_count=count,
      timeout_s=timeout_s,
    )
  logger.info("grain_jax_sync: no key-value store client; exchanging via collectives")
  return CollectiveExchange(process_index=index, process_count=count)
