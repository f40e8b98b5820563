"""Orbax checkpointing of a `JaxBatchIterator` through Grain's handler.

Grain's `grain.checkpoint.CheckpointHandler` writes one JSON file per process
(``process_{i}-of-{n}.json``) for a `grain.DatasetIterator` (JSON dict
state) or a `grain.DataLoaderIterator` (JSON bytes state). A
`JaxBatchIterator` is neither, so these helpers wrap it in a small adapter
with the `DataLoaderIterator` protocol (`get_state() -> bytes`,
`set_state(bytes)`, `start_prefetch()`) and return Grain's own
`CheckpointSave` / `CheckpointRestore` arguments. The iterators that
`grain_jax_sync.device_put` returns are `grain.DatasetIterator`s and need no
adapter.

The adapter exports the state inside `sources.base.exporting_to_files()`, so
a source with a size limit on its JSON state (a tf.data iterator, whose
state holds its shuffle buffer) writes it whole: base64 of TensorFlow's
serialized iterator, in the same per-process file.

Grain and Orbax are imported only when these helpers are called.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  import grain

from grain_jax_sync._src import extras
from grain_jax_sync._src.sources import base


class _GrainStateAdapter:
  """A `JaxBatchIterator` as Grain's handler sees a `DataLoaderIterator`."""

  def __init__(self, iterator: Any):
    self._it = iterator

  def get_state(self) -> bytes:
    with base.exporting_to_files():
      state = self._it.get_state()
    return json.dumps(state, indent=2, sort_keys=True).encode("utf-8")

  def set_state(self, state: bytes) -> None:
    self._it.set_state(json.loads(state.decode("utf-8")))

  def start_prefetch(self) -> None:
    pass


def _item(iterator: Any) -> Any:
  grain = extras.require("grain", needed_by="grain_jax_sync checkpointing (Orbax)", extra="orbax")

  if isinstance(iterator, (grain.DatasetIterator, grain.DataLoaderIterator)):
    return iterator
  if not (
    callable(getattr(iterator, "get_state", None))
    and callable(getattr(iterator, "set_state", None))
  ):
    raise ValueError(
      "`iterator` must have get_state() and set_state() (a JaxBatchIterator or"
      f" a Grain iterator), got {type(iterator).__qualname__}"
    )
  return _GrainStateAdapter(iterator)


def _grain_args() -> tuple[type, type]:
  ckpt = extras.require(
    "grain.checkpoint", needed_by="grain_jax_sync checkpointing (Orbax)", extra="orbax"
  )
  save = getattr(ckpt, "CheckpointSave", None)
  restore = getattr(ckpt, "CheckpointRestore", None)
  if save is None or restore is None:
    # Grain defines them only when orbax-checkpoint imports.
    raise ImportError(
      "grain_jax_sync checkpointing (Orbax) needs the optional dependency"
      " 'orbax' (grain.checkpoint has no CheckpointSave without it). Install"
      f" it with: {extras.install_command('orbax')}",
      name="orbax",
    )
  return save, restore


def checkpoint_save(iterator: Any) -> grain.checkpoint.CheckpointSave:
  """Orbax save arguments for `iterator`, handled by Grain's handler.

  Args:
    iterator: A `JaxBatchIterator`, or an iterator from
      `grain_jax_sync.device_put` (or any Grain iterator).

  Returns:
    A `grain.checkpoint.CheckpointSave`; every process writes its own
    ``process_{i}-of-{n}.json`` with the state after the last batch it
    received.

  Raises:
    ValueError: If `iterator` has no `get_state`/`set_state`.
    ImportError: If Grain or Orbax is not installed (names the command).

  Example:

    >>> mngr = ocp.CheckpointManager(path)
    >>> mngr.save(step, args=ocp.args.Composite(
    ...     data=checkpoint_save(it), params=ocp.args.StandardSave(params)))
  """
  save, _ = _grain_args()
  return save(_item(iterator))


def checkpoint_restore(iterator: Any) -> grain.checkpoint.CheckpointRestore:
  """Orbax restore arguments that set `iterator`'s state in place.

  Args:
    iterator: A freshly built iterator of the same pipeline on the same
      process (a `JaxBatchIterator` or a `device_put` iterator).

  Returns:
    A `grain.checkpoint.CheckpointRestore`; restoring it calls
    `iterator.set_state` with this process's saved state.

  Raises:
    ValueError: If `iterator` has no `get_state`/`set_state`.
    ImportError: If Grain or Orbax is not installed (names the command).

  Example:

    >>> it = iter_jax_batches(make_pipeline(), batch_size=32, paddings=0)
    >>> mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
    ...     data=checkpoint_restore(it)))
  """
  _, restore = _grain_args()
  return restore(_item(iterator))
