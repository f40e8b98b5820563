"""The Grain dataset and iterator that `device_put` returns.

They subclass Grain's `IterDataset` and `DatasetIterator`, made on first use
(`sources.grain.grain_class`) so that ``import grain_jax_sync`` never loads
Grain. The iterator reads the first element to choose its mode: global
batches through a `JaxBatchIterator`, or, on one process, elements placed one
by one as `jax.device_put` places them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from grain_jax_sync._src import extras, prefetch
from grain_jax_sync._src import iterator as iterator_lib
from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src import placement as placement_lib
from grain_jax_sync._src.sources import grain as grain_source


def _unbatched(element: Any) -> str | None:
  """Why `element` is not a batch (a scalar leaf, unequal leading sizes), or None."""
  leaves = jax.tree_util.tree_leaves(element)
  if any(np.ndim(x) == 0 for x in leaves):
    return "it has a scalar (0-d) leaf"
  firsts = {np.shape(x)[0] for x in leaves}
  if len(firsts) > 1:
    return f"its leaves have different leading sizes {sorted(firsts)}"
  return None


def _plain_first(
  parent: Any,
  options: options_lib.Options,
  placement: placement_lib.DevicePutPlacement,
) -> tuple[bool, tuple[Any, Any] | None]:
  """Whether elements are placed one by one, and the first element with the state before it.

  The element read is handed on rather than read again: rewinding a Grain
  iterator drops what its threads or worker processes read ahead, and they
  make it again. None where nothing was read. ValueError if options that
  need global batches are given.
  """
  if jax.process_count() > 1:  # Unbatched elements fail validation everywhere.
    return False, None
  start = parent.get_state()  # Before the first read, as Grain's `device_put` takes it.
  first = next(parent, None)
  why = None if first is None else _unbatched(first)
  if first is None or not (why or placement.per_leaf):
    return False, None if first is None else (first, start)
  given = [k for k in ("paddings", "dtypes") if getattr(options, k) is not None]
  given += [k for k in ("mask_key", "drop_last") if getattr(options, k)]
  given += ["pad_shapes"] if options.pad_shapes is not None else []
  if given:
    if why:
      why = f"the first element is unbatched ({why})"
    elif placement.element is None:
      why = "`device` is None (the default device, as for jax.device_put)"
    else:
      why = "`device` is a pytree of different placements"
    raise ValueError(
      f"`{'`, `'.join(given)}` need global batches, but {why}, so"
      " elements are placed one by one as jax.device_put places them."
      " Batch the dataset first (e.g. `ds.batch(n)`) and pass one sharding"
    )
  return True, (first, start)


class SyncedDatasetIterator:  # The Grain base comes with `grain_class`.
  """Global `jax.Array` batches that every host agrees on.

  `get_state`/`set_state` (which also takes the state Grain's own
  `device_put` iterator saved), `request_stop()`, `stop_requested_by` and
  `stats()` are those of `JaxBatchIterator`. On one process, unbatched
  elements (and every element under a pytree of different shardings) are
  placed as `jax.device_put` places them.

  The parent's state is taken before its first read, as Grain's
  `device_put` takes it: Grain then starts `mp_prefetch` workers one after
  the other, and the job reads them in the phase Grain's does.
  """

  _MUTATES_ELEMENT_SPEC = True
  # Grain's DatasetIterator (the other base) sets and defines these.
  _closed: bool
  _assert_not_closed: Any

  def __init__(
    self,
    parent: Any,
    options: Any,
    placement: placement_lib.DevicePutPlacement,
  ):
    grain = extras.require("grain", needed_by="grain_jax_sync.device_put")
    # A parent that is no Grain `DatasetIterator` (a plain iterator an
    # `IterDataset` returns) is read as it is, as Grain's prefetch reads it.
    native = isinstance(parent, grain.DatasetIterator)
    super().__init__(parent if native else ())  # type: ignore[call-arg]  # Grain's base.
    self._source_it = parent
    self._options = options
    self._placement = placement
    self._jax: iterator_lib.JaxBatchIterator | None = None
    self._plain = False  # Elements placed one by one, as jax.device_put does.
    self._first: list[Any] = []  # The element read to choose the mode.
    self._restored: dict[str, Any] | None = None
    self._count = 0
    self._stop_asked = False  # Set without a lock (a handler); handed on at the start.
    self._plain_stopped = False  # Placed one by one: the stream ended by the request.

  @property
  def _parent(self) -> Any:
    return self._source_it

  def _choose(self) -> None:
    """Reads the first element to choose the mode, once."""
    self._assert_not_closed()
    if self._jax is not None or self._plain:
      return
    plain, first = _plain_first(self._parent, self._options, self._placement)
    if plain:
      self._plain = True
      self._first.append(first[0])  # type: ignore[index]  # A plain parent gave its first element.
      return
    source = grain_source.open_grain(self._parent, first=first)
    if source is None:  # Not a Grain iterator: read again from the start.
      if first is not None:
        self._parent.set_state(first[1])
      source = self._parent
    batches = iterator_lib.JaxBatchIterator(
      source, options=self._options, placement=self._placement.batches
    )
    if self._restored is not None:
      batches.set_state(self._restored)
    self._jax = batches  # Restored first: `set_state` would drop a request.
    if self._stop_asked:  # Asked before: read after publishing, so none is lost.
      batches.request_stop()

  def __next__(self) -> Any:
    self._choose()
    if self._jax is not None:
      return next(self._jax)
    if self._stop_asked and not self._first:  # One process; the element read to choose is due.
      self._plain_stopped = True
      raise StopIteration
    element = self._first.pop() if self._first else next(self._parent)
    self._count += 1
    return jax.device_put(element, self._placement.element)

  def batch_specs(self) -> list[Any]:
    """`JaxBatchIterator.batch_specs`; a ValueError where elements are placed one by one."""
    self._choose()
    if self._jax is None:
      raise ValueError("batch_specs() needs global batches; these elements are placed one by one")
    return self._jax.batch_specs()

  def get_state(self) -> dict[str, Any]:
    if self._jax is not None:
      return self._jax.get_state()
    if self._first:  # Read to choose the mode, not yet returned.
      raise RuntimeError("internal: state asked between choosing and returning")
    return iterator_lib.make_state(self._count, self._parent.get_state(), self._options)

  def set_state(self, state: Any) -> None:
    if isinstance(state, Mapping) and "version" in state and "source" in state:
      state = dict(state)
    else:  # The state Grain's `device_put` iterator saved: its parent's, as our source's.
      state = iterator_lib.make_state(0, state)
    self._stop_asked = self._plain_stopped = False  # A stream no request has touched.
    if self._jax is not None:
      self._jax.set_state(state)
      return
    self._first.clear()
    self._parent.set_state(state["source"])
    self._count = int(state["batches"])
    self._restored = state

  def request_stop(self) -> None:
    """Ends every host's stream at one batch, as `JaxBatchIterator.request_stop` (a signal handler too)."""
    self._stop_asked = True
    batches = self._jax
    if batches is not None:
      batches.request_stop()

  @property
  def stop_requested_by(self) -> int | None:
    """The process whose `request_stop()` ended the stream (the same on every host), or None."""
    if self._jax is not None:
      return self._jax.stop_requested_by
    return jax.process_index() if self._plain_stopped else None

  def stats(self, *, all_hosts: bool = False) -> dict[str, Any] | None:
    """`JaxBatchIterator.stats()`; None before the first batch, and where elements are placed one by one."""
    return None if self._jax is None else self._jax.stats(all_hosts=all_hosts)

  def close(self) -> None:
    if self._closed:
      return
    if self._jax is not None:
      self._jax.close()  # Stops the pipeline thread, then closes `parent`.
    else:
      prefetch.close_producer(self._parent)  # Where it has a `close`.
    self._closed = True

  @property
  def sharding(self) -> jax.sharding.Sharding | None:
    """Every leaf's sharding in a global batch (None where elements are placed one by one)."""
    if self._jax is not None:
      return self._jax.sharding
    return None if self._placement.per_leaf else self._placement.batches.sharding

  def __str__(self) -> str:
    return "SyncedDatasetIterator"


class SyncedIterDataset:  # The Grain base comes with `grain_class`.
  """The dataset `device_put` returns; each `iter()` starts a fresh run."""

  _parent: Any  # Set by Grain's IterDataset (the other base).

  def __init__(self, parent: Any, options: Any, placement: placement_lib.DevicePutPlacement):
    super().__init__(parent)  # type: ignore[call-arg]  # Grain's base.
    self._args = (options, placement)

  def __iter__(self) -> Any:
    iterator = grain_source.grain_class(SyncedDatasetIterator, "DatasetIterator")
    return iterator(self._parent.__iter__(), *self._args)

  def __str__(self) -> str:
    return "grain_jax_sync.device_put"
