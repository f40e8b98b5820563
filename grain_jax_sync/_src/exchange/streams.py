"""This process's streams: their names, and where each stands. No store call.

An iterator's key prefix (`new_namespace`) is the same on every process;
each (re)start of it is a stream, ``{prefix}/{generation}``. `REGISTRY` records
the iterators created here, the streams started here, waiting for their first
decision (the beat carries those) or ended before they started, and the closes.
"""

from __future__ import annotations

import collections
import itertools
import threading

KEY_ROOT = "grain_jax_sync"  # Every key of the library lives under it.


class _Registry:
  """The library's one process-wide registry, every field guarded by `lock`: a process's
  iterators know each other's streams (`agreement.driver.Driver.crosswise`)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.instances = itertools.count()
    self.named: collections.Counter[str] = collections.Counter()
    self.created: set[str] = set()  # Iterators' key prefixes (`new_namespace`).
    self.started: set[str] = set()
    self.waiting_first: set[str] = set()
    self.pre_ended: dict[str, str] = {}  # Stream -> the ending posted here before it started.
    self.closes = 0  # Closes recorded (`exchange.register_close`); the beat carries the count.


REGISTRY = _Registry()


def new_namespace(name: str | None = None) -> str:
  """A key prefix for one iterator; the same on every process where every process creates its
  iterators in the same order, else by `name` (the same number of that name everywhere)."""
  with REGISTRY.lock:
    if name is None:
      namespace = f"{KEY_ROOT}/{next(REGISTRY.instances)}"
    else:
      # The n-th of that name: a new one per epoch reads none of the last's keys.
      REGISTRY.named[name] += 1
      namespace = f"{KEY_ROOT}/{name}/{REGISTRY.named[name]}"
    REGISTRY.created.add(namespace)
  return namespace


def stream_started(namespace: str) -> None:
  """Records that this process started stream `namespace`."""
  with REGISTRY.lock:
    REGISTRY.started.add(namespace)


def made_not_started(namespace: str) -> bool:
  """Whether the iterator of stream `namespace` was created in this process, which did not start it."""
  with REGISTRY.lock:
    return namespace.rsplit("/", 1)[0] in REGISTRY.created and namespace not in REGISTRY.started


def waiting_first(namespace: str, waiting: bool) -> None:
  """Marks this process as waiting (or no longer) for `namespace`'s first decision."""
  with REGISTRY.lock:
    if waiting:
      REGISTRY.waiting_first.add(namespace)
    else:
      REGISTRY.waiting_first.discard(namespace)


def pre_end(namespace: str, message: str) -> None:
  """Records that this process posted `message` as its ending of a stream it never started."""
  with REGISTRY.lock:
    REGISTRY.pre_ended[namespace] = message


def pre_ended(namespace: str | None) -> str | None:
  """The ending this process posted to `namespace` before starting it, if any."""
  if namespace is None:
    return None
  with REGISTRY.lock:
    return REGISTRY.pre_ended.get(namespace)


def count_close() -> None:
  """Counts one more close recorded by this process (its beat carries the count)."""
  with REGISTRY.lock:
    REGISTRY.closes += 1


def forget(prefix: str) -> None:
  """Drops what this process recorded of the iterator `prefix` and its streams (it closed)."""
  with REGISTRY.lock:
    REGISTRY.created.discard(prefix)
    for streams in (REGISTRY.started, REGISTRY.waiting_first):
      streams.difference_update([s for s in streams if s.rsplit("/", 1)[0] == prefix])
    for s in [s for s in REGISTRY.pre_ended if s.rsplit("/", 1)[0] == prefix]:
      del REGISTRY.pre_ended[s]


def recorded() -> list[str]:
  """Every iterator and stream this process records (a closed one leaves none)."""
  with REGISTRY.lock:
    r = REGISTRY
    return sorted({*r.created, *r.started, *r.waiting_first, *r.pre_ended})


def beat_streams() -> tuple[int, list[str]]:
  """The closes counted and the streams this process waits on for a first decision (its beat)."""
  with REGISTRY.lock:
    return REGISTRY.closes, sorted(REGISTRY.waiting_first)
