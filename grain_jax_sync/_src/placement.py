"""Where a batch's rows go: shardings, data shards, processes that share rows.

`resolve_sharding` turns the user's `mesh`/`data_axes`/`sharding` (or the
context or default mesh) into a `BatchPlacement`: the sharding, the data
shards this process holds, and which processes feed identical rows. The
global batch has rows per data shard x data shards, so processes that hold the
same data shards (a model axis across processes) do not add to it
(`shard_layout.py` says which processes hold which blocks). No `jax.Array`
is made here (`sharding.py` does that).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from grain_jax_sync._src import meshes
from grain_jax_sync._src.shard_layout import cut, local_to_global_shape
from grain_jax_sync._src.shard_layout import dim_layout as _dim_layout  # Tests reach it here.

logger = logging.getLogger(__name__)


class DataShardInfo(NamedTuple):
  """Which share of the data this process loads (Grain's `ShardOptions` fields).

  Processes that feed the same rows (a model axis across processes) get the
  same `shard_index`; `shard_index` runs over ``range(shard_count)`` in the
  order of the rows in the global batch.
  """

  shard_index: int
  shard_count: int


@dataclasses.dataclass(frozen=True)
class BatchPlacement:
  """Where every batch goes: the sharding and this process's data shards.

  Built once per iterator by `resolve_sharding`; `to_global_leaves` takes it.
  A *data shard* is a block of rows on the devices (one per index of the data
  axes). This process holds `local_blocks` of them; its local rows, split into
  ``len(local_blocks)`` equal parts, go in order to those blocks, which need
  not be adjacent in the global batch. Processes in one `groups` entry hold
  the same data shards and must feed identical rows.

  Attributes:
    sharding: The sharding of every leaf (a spec is cut to a leaf's rank).
    shard_index: This process's input shard (its entry in `groups`).
    shard_count: Input shards: distinct sets of rows that processes feed.
    num_blocks: Data shards of the global batch.
    local_blocks: The data shards this process holds, ascending.
    groups: Per input shard, the processes that feed it.
    chosen_by: How the sharding was chosen (for logs and `doctor`).
  """

  sharding: jax.sharding.Sharding
  shard_index: int
  shard_count: int
  num_blocks: int
  local_blocks: tuple[int, ...]
  groups: tuple[tuple[int, ...], ...]
  chosen_by: str

  @property
  def local_shards(self) -> int:
    """Data shards this process holds: its local rows must divide among them."""
    return len(self.local_blocks)

  @property
  def shares_rows(self) -> bool:
    """Whether some processes feed identical rows (the same on every host)."""
    return any(len(g) > 1 for g in self.groups)

  @functools.cached_property
  def single_process(self) -> bool:
    """Whether this is the only process (global shapes are local shapes)."""
    return jax.process_count() == 1

  def sharding_for(self, ndim: int) -> jax.sharding.Sharding:
    """The sharding of a leaf of rank `ndim`."""
    return cut(self.sharding, ndim)

  def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
    """The global shape of a leaf this process feeds with `local_shape`."""
    return local_to_global_shape(local_shape, self.sharding)

  def describe_local(self) -> str:
    """What local rows must divide among, for messages."""
    devices = jax.local_device_count()
    if self.local_shards == devices:
      return f"the {devices} local devices"
    return f"the {self.local_shards} data shards that this process's {devices} local devices hold"

  def fingerprint(self) -> dict[str, str]:
    """What every process's sharding must share, for the first report.

    The mesh's axes and shape, the spec, and a digest of the global device
    order (two meshes of the same shape over the same devices in another
    order place rows differently, and `make_array_from_process_local_data`
    checks neither: the job hangs in the transfer or computes on mixed rows).
    """
    s = self.sharding
    if isinstance(s, jax.sharding.NamedSharding):
      mesh = s.mesh
      what = f"mesh {dict(mesh.shape)}, spec {tuple(s.spec)}"
      order = [d.id for d in mesh.devices.flat]
    else:
      what = type(s).__name__
      order = [d.id for d in getattr(s, "_device_assignment", sorted(s.device_set, key=_id))]
    text = ",".join(map(str, order))
    digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:12]
    return {"sharding": what, "sharding_device_order": f"{len(order)} devices, digest {digest}"}

  def describe(self) -> str:
    """One line: the sharding, its data shards and this process's share."""
    return (
      f"{self.sharding} (from {self.chosen_by}): {self.num_blocks} data shards;"
      f" process {jax.process_index()} feeds data shards {list(self.local_blocks)}"
      f" as input shard {self.shard_index} of {self.shard_count}"
      + (
        f", shared with processes {list(self.groups[self.shard_index])}" if self.shares_rows else ""
      )
    )


def _id(device: Any) -> int:
  return device.id


def _check_covers(sharding: jax.sharding.Sharding, what: str) -> None:
  """With several processes, the sharding must span every device of the job."""
  if jax.process_count() == 1:
    return
  have = sharding.device_set
  every = jax.devices()
  missing = [d for d in every if d not in have]
  if missing:
    procs = sorted({d.process_index for d in missing})
    raise ValueError(
      f"{what} must span every device of the job: it has {len(have)} of the"
      f" {len(every)} devices ({len(missing)} devices of processes {procs} are"
      " missing). Build the mesh from jax.devices(), not jax.local_devices(),"
      " e.g. grain_jax_sync.default_mesh()"
    )


def _check_trailing_whole(sharding: jax.sharding.Sharding, what: str) -> None:
  """Every process must hold every block of each dimension after the rows.

  Processes that hold different blocks of a trailing dimension hold the same
  rows (the axis that splits it spans processes): their rows would be
  compared as replicas, which they are not, and a process that fed its whole
  columns would see them repeated in the global array.
  """
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return
  ndim = len(sharding.spec)
  for dim in range(1, ndim):
    if sharding.spec[dim] is None:
      continue
    lay = _dim_layout(sharding, dim, ndim)  # Raises where processes hold blocks unevenly.
    if len(lay.groups) > 1:
      held = "; ".join(
        f"processes {list(ps)} hold {list(b)}"
        for ps, b in list(zip(lay.groups, lay.group_blocks, strict=True))[:4]
      )
      raise ValueError(
        f"{what} splits dimension {dim} into {lay.num_blocks} blocks across"
        f" processes ({held}; spec {sharding.spec}); expected the dimensions after"
        " the rows whole on every process: batches are fed whole by each process."
        " Split them over axes within a process, or replicate them"
      )


def placement_for(sharding: jax.sharding.Sharding, chosen_by: str) -> BatchPlacement:
  """The `BatchPlacement` of a sharding, checked for this job."""
  _check_covers(sharding, chosen_by)
  _check_trailing_whole(sharding, chosen_by)
  lay = _dim_layout(cut(sharding, 1), 0, 1)
  group = lay.group_of(jax.process_index())
  placement = BatchPlacement(
    sharding=sharding,
    shard_index=group,
    shard_count=len(lay.groups),
    num_blocks=lay.num_blocks,
    local_blocks=lay.group_blocks[group],
    groups=lay.groups,
    chosen_by=chosen_by,
  )
  meshes.log_once(f"grain_jax_sync: batches go to {placement.describe()}", logger)
  return placement


def _named(mesh: Any, spec: jax.sharding.PartitionSpec, what: str) -> jax.sharding.NamedSharding:
  try:
    return jax.sharding.NamedSharding(mesh, spec)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{what} {spec} does not fit the mesh {dict(mesh.shape)}: {e}") from e


def resolve_sharding(
  *,
  mesh: jax.sharding.Mesh | None = None,
  data_axes: str | Sequence[str] | None = None,
  sharding: jax.sharding.Sharding | jax.sharding.PartitionSpec | None = None,
) -> BatchPlacement:
  """Picks the sharding of every batch and this process's share of its rows.

  In order: a full `sharding`; `mesh` with rows over `data_axes` (or a
  `sharding` PartitionSpec applied to it); the mesh set by `jax.set_mesh`;
  `meshes.default_mesh()`. A mesh alone splits rows over `data_axes`
  (default ``"data"`` if the mesh has it, else every axis) and replicates them
  over the other axes.

  Args:
    mesh: A `jax.sharding.Mesh` over every device of the job.
    data_axes: The mesh axes the rows are split over.
    sharding: A `jax.sharding.Sharding`, or a `PartitionSpec` applied to
      `mesh` (or to the context or default mesh).

  Returns:
    The `BatchPlacement`.

  Raises:
    ValueError: For conflicting or bad arguments, a mesh that misses devices
      of the job, or a sharding whose rows processes hold unevenly.
  """
  if isinstance(sharding, jax.sharding.Sharding):
    if mesh is not None or data_axes is not None:
      raise ValueError(
        "`sharding` is a full jax.sharding.Sharding, so `mesh` and `data_axes`"
        " must be None; pass a PartitionSpec as `sharding` to apply it to `mesh`"
      )
    return placement_for(sharding, "the `sharding` argument")
  if sharding is not None and not isinstance(sharding, jax.sharding.PartitionSpec):
    raise ValueError(
      "`sharding` must be a jax.sharding.Sharding, a PartitionSpec or None, got"
      f" {type(sharding).__qualname__}: {sharding!r:.200}"
    )
  if sharding is not None and data_axes is not None:
    raise ValueError("pass `data_axes` or a PartitionSpec as `sharding`, not both")
  if mesh is not None:
    if not isinstance(mesh, jax.sharding.Mesh):
      raise ValueError(
        f"`mesh` must be a concrete jax.sharding.Mesh, got {type(mesh).__qualname__}: {mesh!r:.200}"
      )
    chosen_by = "the `mesh` argument"
  else:
    mesh = meshes.context_mesh()
    chosen_by = "the context mesh (jax.set_mesh)"
    if mesh is None:
      mesh = meshes.default_mesh()
      chosen_by = "the default mesh"
  if sharding is None:
    spec = meshes.data_spec(mesh, data_axes)
    what = "`data_axes`"
  else:
    spec, what = sharding, "`sharding`"
    chosen_by += " with the `sharding` PartitionSpec"
  return placement_for(_named(mesh, spec, what), chosen_by)


def data_shard_info(
  mesh_or_sharding: Any = None, *, data_axes: str | Sequence[str] | None = None
) -> DataShardInfo:
  """Which share of the data this process must load, for a mesh or sharding.

  Processes that hold the same rows of the global batch (a model axis that
  spans processes) get the same `shard_index`, so that they load identical
  rows: pass it to Grain
  (``grain.sharding.ShardOptions(*data_shard_info(mesh))``) or
  to `tfds_pipeline(mesh=...)`, with the same seed on every process.

  Args:
    mesh_or_sharding: A `Mesh` (rows over `data_axes`), a `Sharding`, a
      `PartitionSpec` (applied to the context or default mesh) or None (the
      context mesh, else the default mesh), as `iter_jax_batches` resolves it.
    data_axes: With a mesh: the axes the rows are split over.

  Returns:
    ``DataShardInfo(shard_index, shard_count)``.

  Example:

    >>> # 2 processes x 4 devices, mesh (data=4, model=2), model pairs across processes:
    >>> data_shard_info(mesh)
    DataShardInfo(shard_index=0, shard_count=1)
  """
  if isinstance(mesh_or_sharding, jax.sharding.Mesh):
    p = resolve_sharding(mesh=mesh_or_sharding, data_axes=data_axes)
  else:
    p = resolve_sharding(sharding=mesh_or_sharding, data_axes=data_axes)
  return DataShardInfo(p.shard_index, p.shard_count)
