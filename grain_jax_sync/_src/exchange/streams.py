"""This process's streams: their names, and where each stands. No store call.

An iterator's key prefix (`new_namespace`) is the same on every process;
each (re)start of it is a stream, ``{prefix}/{generation}``. The registry
records which iterators were created here and which streams were started
here, wait for their first decision (the beat carries those:
`agreement.cross_wait`), or were ended here before they started (`pre_end`).
"""

from __future__ import annotations

import collections
import itertools
import threading

KEY_ROOT = "grain_jax_sync"  # Every key of the library lives under it.
_instances = itertools.count()
_named: collections.Counter[str] = collections.Counter()
_created: set[str] = set()  # Iterators' key prefixes (`new_namespace`).
_started: set[str] = set()
_waiting_first: set[str] = set()
_pre_ended: dict[str, str] = {}  # Stream -> the ending posted here before it started.
_streams_lock = threading.Lock()


def new_namespace(name: str | None = None) -> str:
  """A key prefix for one iterator; the same on every process under SPMD.

  A per-process counter names them consistently where every process creates
  its iterators in the same order; where not, pass `name` (every process
  must then create the same number of iterators of that name).
  """
  if name is None:
    namespace = f"{KEY_ROOT}/{next(_instances)}"
  else:
    # The n-th iterator of that name: a new one per epoch under the same name
    # must not read the keys of the last (a host still ending it, or its
    # decider still posting).
    _named[name] += 1
    namespace = f"{KEY_ROOT}/{name}/{_named[name]}"
  with _streams_lock:
    _created.add(namespace)
  return namespace


def stream_started(namespace: str) -> None:
  """Records that this process started stream `namespace`."""
  with _streams_lock:
    _started.add(namespace)


def is_started(namespace: str) -> bool:
  """Whether this process started stream `namespace`."""
  return namespace in _started


def is_created(namespace: str) -> bool:
  """Whether the iterator of stream `namespace` was created in this process."""
  return namespace.rsplit("/", 1)[0] in _created


def waiting_first(namespace: str, waiting: bool) -> None:
  """Marks this process as waiting (or no longer) for `namespace`'s first decision."""
  with _streams_lock:
    if waiting:
      _waiting_first.add(namespace)
    else:
      _waiting_first.discard(namespace)


def pre_end(namespace: str, message: str) -> None:
  """Records that this process posted `message` as its ending of a stream it never started."""
  with _streams_lock:
    _pre_ended[namespace] = message


def pre_ended(namespace: str | None) -> str | None:
  """The ending this process posted to `namespace` before starting it, if any."""
  return None if namespace is None else _pre_ended.get(namespace)


def forget(prefix: str) -> None:
  """Drops what this process recorded of the iterator `prefix` and its streams (it closed)."""
  with _streams_lock:
    _created.discard(prefix)
    for streams in (_started, _waiting_first):
      streams.difference_update([s for s in streams if s.rsplit("/", 1)[0] == prefix])
    for s in [s for s in _pre_ended if s.rsplit("/", 1)[0] == prefix]:
      del _pre_ended[s]


def recorded() -> list[str]:
  """Every iterator and stream this process records (a closed one leaves none)."""
  with _streams_lock:
    return sorted({*_created, *_started, *_waiting_first, *_pre_ended})


def waiting_streams() -> list[str]:
  """The streams this process waits on for a first decision (the beat carries them)."""
  with _streams_lock:
    return sorted(_waiting_first)
