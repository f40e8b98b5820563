"""Orbax checkpointing of a `JaxBatchIterator` through Grain's handler.

Grain's handler writes one JSON file per process (``process_{i}-of-{n}.json``)
for a Grain iterator; a `JaxBatchIterator` goes through an adapter with the
`DataLoaderIterator` protocol, which exports inside `exporting_to_files()` (a
tf.data state over the JSON size limit is written whole).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  import grain

from grain_jax_sync._src import extras
from grain_jax_sync._src.sources import base
from grain_jax_sync._src.sources.elastic import state as elastic_state


class _GrainStateAdapter:
  """A `JaxBatchIterator` as Grain's handler sees a `DataLoaderIterator`."""

  def __init__(self, iterator: Any):
    self._it = iterator

  def get_state(self) -> bytes:
    with base.exporting_to_files():
      state = self._it.get_state()
    return json.dumps(state, indent=2, sort_keys=True).encode("utf-8")

  def set_state(self, state: bytes | list[bytes]) -> None:
    """From this process's file, or every old process's in process order (another count)."""
    self._it.set_state(
      [json.loads(s) for s in state] if isinstance(state, list) else json.loads(state)
    )

  def start_prefetch(self) -> None:
    pass


_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def old_job_files(directory: Any) -> list[Any]:
  """Every old process's file in `directory`, in process order; ValueError unless one job's."""
  found: dict[int, dict[int, Any]] = {}
  for path in directory.iterdir():
    m = _FILE.fullmatch(path.name)
    if m:
      found.setdefault(int(m.group(2)), {})[int(m.group(1))] = path
  if len(found) != 1:
    raise ValueError(
      f"{directory} holds the data states of {len(found)} process counts"
      f" ({sorted(found)}); expected one job's process_<i>-of-<n>.json files"
    )
  ((count, files),) = found.items()
  if sorted(files) != list(range(count)):
    missing = sorted(set(range(count)) - set(files))
    raise ValueError(f"{directory} lacks the data states of processes {missing} of {count}")
  return [files[i] for i in range(count)]


def _elastic(path: Any) -> bool:
  """Whether the state file at `path` is an elastic source's."""
  source = json.loads(path.read_text()).get("source")
  return isinstance(source, dict) and source.get("format") == elastic_state.FORMAT


@functools.cache
def _elastic_args() -> tuple[type, type]:
  """Orbax (save, restore) arguments whose handler also restores from another count's files.

  One handler for both: an Orbax manager holds one handler per item.
  """
  ocp = extras.require("orbax.checkpoint", needed_by="grain_jax_sync checkpointing", extra="orbax")
  from grain._src.python.checkpoint import handler as grain_handler  # pylint: disable=g-import-not-at-top

  class ElasticCheckpointHandler(grain_handler.CheckpointHandler):
    """Grain's handler; without this process's file, or with an elastic source's (which takes
    new mixture weights or a new `batch_size` only from the list), every old process's files."""

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
      item = item or args.item
      import jax  # pylint: disable=g-import-not-at-top

      own = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
      if not isinstance(item, _GrainStateAdapter) or (own.exists() and not _elastic(own)):
        return super().restore(directory, item=item, args=args)
      item.set_state([f.read_bytes() for f in old_job_files(directory)])
      return item

  save: Any
  restore: Any
  save, restore = _grain_args()

  @ocp.args.register_with_handler(ElasticCheckpointHandler, for_save=True)
  @dataclasses.dataclass
  class ElasticCheckpointSave(save):
    """`grain.checkpoint.CheckpointSave`, handled by `ElasticCheckpointHandler` (Grain's save)."""

  @ocp.args.register_with_handler(ElasticCheckpointHandler, for_restore=True)
  @dataclasses.dataclass
  class ElasticCheckpointRestore(restore):
    """`grain.checkpoint.CheckpointRestore`, handled by `ElasticCheckpointHandler`."""

  return ElasticCheckpointSave, ElasticCheckpointRestore


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
  return _args(iterator, 0)


def checkpoint_restore(iterator: Any) -> grain.checkpoint.CheckpointRestore:
  """Orbax restore arguments that set `iterator`'s state in place.

  Args:
    iterator: A freshly built iterator of the same pipeline on the same
      process (a `JaxBatchIterator` or a `device_put` iterator).

  Returns:
    A `grain.checkpoint.CheckpointRestore` (a subclass, for a
    `JaxBatchIterator`); restoring it calls `iterator.set_state` with this
    process's saved state or, if the checkpoint was saved on another process
    count, with the list of every old process's state (an iterator over an
    `elastic_source` re-splits them; others refuse, on every host). An
    elastic source's iterator always gets the list, so it takes new mixture
    weights or a new `batch_size` on the same count too.

  Raises:
    ValueError: If `iterator` has no `get_state`/`set_state`.
    ImportError: If Grain or Orbax is not installed (names the command).

  Example:

    >>> it = iter_jax_batches(make_pipeline(), batch_size=32, paddings=0)
    >>> mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
    ...     data=checkpoint_restore(it)))
  """
  return _args(iterator, 1)


def _args(iterator: Any, which: int) -> Any:
  """Save (`which` 0) or restore (1) arguments; a `JaxBatchIterator`'s, with the elastic handler."""
  plain = _grain_args()[which]
  grain = extras.require("grain", needed_by="grain_jax_sync checkpointing (Orbax)", extra="orbax")
  if isinstance(iterator, (grain.DatasetIterator, grain.DataLoaderIterator)):
    return plain(iterator)
  if not all(callable(getattr(iterator, m, None)) for m in ("get_state", "set_state")):
    raise ValueError(
      "`iterator` must have get_state() and set_state() (a JaxBatchIterator or"
      f" a Grain iterator), got {type(iterator).__qualname__}"
    )
  return _elastic_args()[which](_GrainStateAdapter(iterator))
