"""Where a batch's rows go: meshes, shard layout, and each process's share.

Processes that hold the same blocks of a dimension (a model axis across
processes) feed the same data (`dim_layout`). No `jax.Array` is made here.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import operator
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from grain_jax_sync._src import options as options_lib
from grain_jax_sync._src import shapes as shapes_lib

logger = logging.getLogger(__name__)


# -- meshes: the default device order, the context mesh and the data axes -------

DATA_AXIS = "data"

_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(message: str) -> None:
  """Logs `message` at INFO the first time this process sees it."""
  with _logged_lock:
    if message in _logged:
      return
    _logged.add(message)
  logger.info("%s", message)


def slice_indices(devices: Iterable[Any]) -> list[Any]:
  """The distinct ``slice_index`` values the devices report, ascending (none on CPU)."""
  return sorted({s for s in (getattr(d, "slice_index", None) for d in devices) if s is not None})


def default_device_order(devices: Sequence[Any]) -> tuple[np.ndarray, str]:
  """The default 1-D data mesh's devices (or look-alikes), in order, and which rule chose them."""
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top

  devices = list(devices)
  n = len(devices)
  slices = slice_indices(devices)
  if len(slices) > 1:
    per_slice = n // len(slices)
    seen = f"devices report {len(slices)} slice_index values"
    make = functools.partial(
      mesh_utils.create_hybrid_device_mesh, (per_slice,), (len(slices),), devices
    )
    chosen = (
      f"{seen}: create_hybrid_device_mesh, data parallelism across the"
      f" {len(slices)} slices of {per_slice} devices"
    )
    failed = f"{seen} but create_hybrid_device_mesh failed"
  else:
    make = functools.partial(mesh_utils.create_device_mesh, (n,), devices)
    chosen = "one slice: create_device_mesh (topology-aware order)"
    failed = "create_device_mesh failed"
  try:
    order = make()
  except Exception as e:  # noqa: BLE001 - any failure falls back, with the reason.
    fallback = np.empty(n, dtype=object)
    fallback[:] = sorted(devices, key=lambda d: (d.process_index, d.id))
    return fallback, f"{failed} ({type(e).__name__}: {e}); devices ordered by process, then id"
  return np.asarray(order, dtype=object).reshape(-1), chosen


def default_mesh(axis_name: str = DATA_AXIS) -> jax.sharding.Mesh:
  """The default mesh: 1-D over every device of the job, topology-aware.

  One slice: `mesh_utils.create_device_mesh`; several (devices with
  different ``slice_index``): `mesh_utils.create_hybrid_device_mesh` with data
  parallelism across slices; otherwise devices ordered by process, then id.
  The choice and its reason are logged once at INFO.

  Args:
    axis_name: The mesh axis name.

  Returns:
    A 1-D ``jax.sharding.Mesh`` with axis `axis_name`.

  Example:

    >>> mesh = default_mesh()
    >>> mesh.shape
    OrderedDict([('data', 8)])
  """
  order, reason = default_device_order(jax.devices())
  log_once(
    f"grain_jax_sync: default mesh: 1-D {axis_name!r} axis over {len(order)} devices; {reason}"
  )
  return jax.sharding.Mesh(order, (axis_name,))


def default_sharding(axis_name: str = DATA_AXIS) -> jax.sharding.NamedSharding:
  """Rows split over the default mesh (`default_mesh`): 1-D over every device.

  Args:
    axis_name: The mesh axis name.

  Returns:
    ``NamedSharding(default_mesh(axis_name), PartitionSpec(axis_name))``.

  Example:

    >>> sharding = default_sharding()
    >>> sharding.spec == jax.sharding.PartitionSpec("data")
    True
  """
  mesh = default_mesh(axis_name)
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))


def context_mesh() -> jax.sharding.Mesh | None:
  """The concrete mesh set by `jax.set_mesh` (or `jax.sharding.use_mesh`), if any.

  Read in the calling thread: JAX keeps the context per thread.
  """
  get = getattr(jax.sharding, "get_mesh", None)
  if get is None:  # Older JAX: the same value, not yet public.
    from jax._src import mesh as mesh_src  # pylint: disable=g-import-not-at-top

    get = getattr(mesh_src, "get_concrete_mesh", None)
  if get is None:
    return None
  try:
    mesh = get()
  except ValueError:  # Inside a trace: there is no concrete mesh to use.
    return None
  if mesh is None or getattr(mesh, "empty", False) or not getattr(mesh, "axis_names", ()):
    return None
  return mesh


def data_axes_of(mesh: jax.sharding.Mesh, data_axes: str | Sequence[str] | None) -> tuple[str, ...]:
  """The mesh axes the rows are split over (major to minor); None: ``"data"``, else every axis."""
  names = tuple(mesh.axis_names)
  if data_axes is None:
    return (DATA_AXIS,) if DATA_AXIS in names else names
  if not isinstance(data_axes, (str, Sequence)):
    raise TypeError(
      f"`data_axes` must be an axis name or a sequence of them, got {data_axes!r:.100}"
    )
  axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
  if not axes:
    raise ValueError(
      f"`data_axes` must name at least one axis of the mesh {dict(mesh.shape)}, got {data_axes!r}"
    )
  unknown = [a for a in axes if a not in names]
  if unknown or len(set(axes)) != len(axes):
    raise ValueError(
      f"`data_axes` must be distinct axis names of the mesh {dict(mesh.shape)},"
      f" got {data_axes!r}" + (f" ({unknown!r} not in the mesh)" if unknown else "")
    )
  return axes


def data_spec(mesh: jax.sharding.Mesh, data_axes: Any = None) -> jax.sharding.PartitionSpec:
  """``PartitionSpec`` with rows over `data_axes`, replicated over the rest."""
  axes = data_axes_of(mesh, data_axes)
  return jax.sharding.PartitionSpec(axes[0] if len(axes) == 1 else axes)


# -- shard layout: which processes hold which blocks, and the shapes that follow --


@dataclasses.dataclass(frozen=True)
class DimLayout:
  """How one dimension of a sharding splits into blocks and who holds them."""

  num_blocks: int  # Distinct blocks along the dimension (data shards for rows).
  groups: tuple[tuple[int, ...], ...]  # Processes holding the same blocks, by first block.
  group_blocks: tuple[tuple[int, ...], ...]  # The blocks of each group, ascending.

  def group_of(self, process_index: int) -> int:
    """The group that holds `process_index`'s blocks; raises if it holds none."""
    for k, procs in enumerate(self.groups):
      if process_index in procs:
        return k
    raise ValueError(f"process {process_index} holds no device of the sharding")


def _start(index: Any) -> int:
  return (index.start or 0) if isinstance(index, slice) else 0


@functools.lru_cache(maxsize=256)
def dim_layout(sharding: jax.sharding.Sharding, dim: int, ndim: int) -> DimLayout:
  """Blocks of `dim` and the processes that hold each, for any sharding."""
  index_map = sharding.devices_indices_map((sharding.num_devices,) * ndim)
  starts = sorted({_start(idx[dim]) for idx in index_map.values()})
  block_of = {s: k for k, s in enumerate(starts)}
  held: dict[int, set[int]] = collections.defaultdict(set)
  for device, idx in index_map.items():
    # jaxlib's Device stub does not declare `process_index`.
    process: int = device.process_index  # type: ignore[attr-defined]
    held[process].add(block_of[_start(idx[dim])])
  owners: dict[frozenset[int], list[int]] = collections.defaultdict(list)
  for p in sorted(held):
    owners[frozenset(held[p])].append(p)
  counts = sorted({len(b) for b in owners})
  covered = sum(len(b) for b in owners)
  if len(counts) > 1 or covered != len(starts):
    detail = "; ".join(f"processes {ps} hold {sorted(b)}" for b, ps in list(owners.items())[:8])
    raise ValueError(
      f"the sharding {sharding} splits dimension {dim} into {len(starts)} blocks"
      f" that processes hold unevenly ({detail}); expected every process to hold"
      " the same number of blocks, and any two processes the same blocks or"
      " none in common. Order the mesh devices so that each process's devices"
      " form whole blocks"
    )
  ordered = sorted(owners, key=min)
  return DimLayout(
    num_blocks=len(starts),
    groups=tuple(tuple(owners[b]) for b in ordered),
    group_blocks=tuple(tuple(sorted(b)) for b in ordered),
  )


@functools.lru_cache(maxsize=256)
def cut(sharding: jax.sharding.Sharding, ndim: int) -> jax.sharding.Sharding:
  """`sharding` for a leaf of rank `ndim`: a longer spec is cut to the rank."""
  if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) > ndim:
    spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[:ndim])
    return jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
  return sharding


def _as_sharding(sharding: Any) -> jax.sharding.Sharding:
  """`sharding` itself, or a mesh as rows over its data axes."""
  if isinstance(sharding, jax.sharding.Mesh):
    return jax.sharding.NamedSharding(sharding, data_spec(sharding))
  if isinstance(sharding, jax.sharding.Sharding):
    return sharding
  raise ValueError(
    "`sharding` must be a jax.sharding.Sharding or a jax.sharding.Mesh, got"
    f" {type(sharding).__qualname__}: {sharding!r:.200}"
  )


def local_to_global_shape(
  local_shape: Sequence[int], sharding: jax.sharding.Sharding | jax.sharding.Mesh
) -> tuple[int, ...]:
  """The global shape of an array built from this process's `local_shape` data.

  The rule of `jax.make_array_from_process_local_data`: along each dimension
  the global size is the local size times the number of distinct sets of
  blocks of the sharding that processes hold (processes that hold the same
  blocks, a model axis across processes, feed the same data). A spec longer
  than the rank is cut to it; a `Mesh` means rows over its data axes.

  Args:
    local_shape: The shape of this process's data.
    sharding: The sharding of the global array, or a mesh.

  Returns:
    The global shape.

  Raises:
    ValueError: If a local size does not divide among the blocks this process
      holds, or the sharding is not uniform across processes.

  Example:

    >>> # 2 processes x 4 devices, mesh (data=4, model=2), model inside a process:
    >>> local_to_global_shape((8, 3), NamedSharding(mesh, P("data")))
    (16, 3)
  """
  return _reshape(_as_sharding(sharding), _shape("local_shape", local_shape), True)


def _shape(arg: str, shape: Any) -> tuple[int, ...]:
  """`shape` as a tuple of Python ints >= 0 (NumPy's too)."""
  if isinstance(shape, (str, bytes, Mapping)) or not isinstance(shape, (Sequence, np.ndarray)):
    raise TypeError(f"`{arg}` must be a sequence of ints (a shape), got {shape!r:.100}")
  if not all(map(shapes_lib.is_int, shape)) or any(d < 0 for d in shape):
    raise ValueError(f"`{arg}` must be ints >= 0, got {tuple(shape)!r:.100}")
  return tuple(int(d) for d in shape)


@functools.lru_cache(maxsize=1024)
def _reshape(
  sharding: jax.sharding.Sharding, shape: tuple[int, ...], to_global: bool
) -> tuple[int, ...]:
  """This process's data `shape` as the global array's (`to_global`), or back."""
  s = cut(sharding, len(shape))
  pi = jax.process_index()
  out = []
  for dim, size in enumerate(shape):
    lay = dim_layout(s, dim, len(shape))
    held = len(lay.group_blocks[lay.group_of(pi)])
    parts = held if to_global else lay.num_blocks
    if size % parts:
      where, whose = (f" on process {pi}", " that it holds") if to_global else ("", "")
      raise ValueError(
        f"dimension {dim} has {size} entries{where}, not divisible by the"
        f" {parts} blocks of the sharding{whose} ({s}); expected a multiple of {parts}"
      )
    out.append(size // parts * (lay.num_blocks if to_global else held))
  return tuple(out)


def global_to_local_shape(
  global_shape: Sequence[int], sharding: jax.sharding.Sharding | jax.sharding.Mesh
) -> tuple[int, ...]:
  """The shape of this process's data for a global array of `global_shape`.

  The inverse of `local_to_global_shape`.

  Args:
    global_shape: The shape of the global array.
    sharding: Its sharding, or a mesh (rows over its data axes).

  Returns:
    The shape of the data this process feeds.

  Raises:
    ValueError: If a global size does not divide among the sharding's blocks.

  Example:

    >>> global_to_local_shape((16, 3), NamedSharding(mesh, P("data")))
    (8, 3)
  """
  return _reshape(_as_sharding(sharding), _shape("global_shape", global_shape), False)


# -- the placement of every batch: the sharding and this process's share ---------


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

  A *data shard* is a block of rows (one per index of the data axes). This
  process's local rows, split into equal parts, go in order to its
  `local_blocks` (ascending, not necessarily adjacent). `groups`: per input
  shard (`shard_index`), the processes that feed it identical rows.
  `chosen_by`: how the sharding was chosen (for logs and `doctor`).
  """

  sharding: jax.sharding.Sharding
  shard_index: int
  shard_count: int
  num_blocks: int
  local_blocks: tuple[int, ...]
  groups: tuple[tuple[int, ...], ...]
  chosen_by: str

  @property
  def shares_rows(self) -> bool:
    """Whether some processes feed identical rows (the same on every host)."""
    return any(len(g) > 1 for g in self.groups)

  @functools.cached_property
  def single_process(self) -> bool:
    return jax.process_count() == 1

  def check_divisible(self, options: options_lib.Options) -> None:
    """With `paddings`, a given `batch_size` must split over this process's data shards.

    A derived one is checked by `plan.pin`.
    """
    size, shards, devices = options.batch_size, len(self.local_blocks), jax.local_device_count()
    if options.paddings is not None and size is not None and size % shards:
      what = f"{devices} local devices"
      if shards != devices:
        what = f"{shards} data shards that this process's {what} hold"
      raise ValueError(
        f"`batch_size` must be divisible by the {what} when `paddings` is given, got {size}"
      )

  def fingerprint(self) -> dict[str, str]:
    """What every process's sharding must share: mesh, spec and a digest of the device order.

    Another order places rows differently, and `make_array_from_process_local_data`
    does not check: the job hangs in the transfer or computes on mixed rows.
    """
    s = self.sharding
    if isinstance(s, jax.sharding.NamedSharding):
      what = f"mesh {dict(s.mesh.shape)}, spec {tuple(s.spec)}"
      order = [d.id for d in s.mesh.devices.flat]
    else:
      what = type(s).__name__
      by_id = sorted(s.device_set, key=operator.attrgetter("id"))
      order = [d.id for d in getattr(s, "_device_assignment", by_id)]
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


def _check_covers(sharding: jax.sharding.Sharding, what: str) -> None:
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
  """Every process must hold every block after the rows (else non-replicas are compared as such)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return
  ndim = len(sharding.spec)
  for dim in range(1, ndim):
    if sharding.spec[dim] is None:
      continue
    lay = dim_layout(sharding, dim, ndim)  # Raises where processes hold blocks unevenly.
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
  lay = dim_layout(cut(sharding, 1), 0, 1)
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
  log_once(f"grain_jax_sync: batches go to {placement.describe()}")
  return placement


def resolve_placement(
  *,
  mesh: jax.sharding.Mesh | None = None,
  data_axes: str | Sequence[str] | None = None,
  sharding: jax.sharding.Sharding | jax.sharding.PartitionSpec | None = None,
) -> BatchPlacement:
  """Picks the sharding of every batch and this process's share of its rows.

  A full `sharding`; else `mesh` (else the `jax.set_mesh` one, else
  `default_mesh()`) with rows over `data_axes`, or with a `sharding` PartitionSpec.
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
    mesh = context_mesh()
    chosen_by = "the context mesh (jax.set_mesh)"
    if mesh is None:
      mesh = default_mesh()
      chosen_by = "the default mesh"
  if sharding is None:
    spec = data_spec(mesh, data_axes)
    what = "`data_axes`"
  else:
    spec, what = sharding, "`sharding`"
    chosen_by += " with the `sharding` PartitionSpec"
  try:
    named = jax.sharding.NamedSharding(mesh, spec)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{what} {spec} does not fit the mesh {dict(mesh.shape)}: {e}") from e
  return placement_for(named, chosen_by)


def data_shard_info(
  mesh_or_sharding: Any = None, *, data_axes: str | Sequence[str] | None = None
) -> DataShardInfo:
  """Which share of the data this process must load, for a mesh or sharding.

  Processes that hold the same rows of the global batch (a model axis that
  spans processes) get the same `shard_index`, so that they load identical
  rows: pass it to Grain (``grain.sharding.ShardOptions(*data_shard_info(mesh))``)
  or to `tfds_pipeline(mesh=...)`, with the same seed on every process.

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
  mesh = mesh_or_sharding if isinstance(mesh_or_sharding, jax.sharding.Mesh) else None
  sharding = None if mesh is not None else mesh_or_sharding
  p = resolve_placement(mesh=mesh, data_axes=data_axes, sharding=sharding)
  return DataShardInfo(p.shard_index, p.shard_count)


# -- device_put's `device`, resolved once ------------------------------------------

_ONE_PLACEMENT = (jax.sharding.Sharding, jax.sharding.Mesh, jax.sharding.PartitionSpec, jax.Device)


@dataclasses.dataclass(frozen=True)
class DevicePutPlacement:
  """`device_put`'s `device` argument, resolved once (`resolve_device_put`).

  Attributes:
    batches: Where global batches go (under `per_leaf`, the context or default mesh's placement).
    per_leaf: True if `device` places each element as `jax.device_put` does
      (None, or a pytree of different placements; one process only).
    element: What `jax.device_put` gets for an element placed as it is (an
      unbatched element, or any element under `per_leaf`).
  """

  batches: BatchPlacement
  per_leaf: bool
  element: Any


def _resolve_one(device: Any, mesh: Any, data_axes: Any, sharding: Any) -> BatchPlacement:
  if isinstance(device, jax.Device):
    if jax.process_count() > 1:
      raise ValueError(
        f"`device` is the single device {device}, but there are"
        f" {jax.process_count()} processes; pass a sharding (or mesh) that"
        " spans every process's devices, e.g. grain_jax_sync.default_mesh()"
      )
    # JAX 0.12 deprecates building SingleDeviceSharding; older JAX lacks the factory.
    single = getattr(jax.sharding, "make_single_device_sharding", None)
    device = single(device) if single else jax.sharding.SingleDeviceSharding(device)
  if device is not None:
    if mesh is not None or sharding is not None:
      raise ValueError("pass `device`, or `mesh`/`sharding`, not both")
    if isinstance(device, jax.sharding.Mesh):
      mesh = device  # Rows over the data axes, replicated over the rest.
    else:  # A Sharding or a PartitionSpec (`resolve_device_put` checked).
      sharding = device
  return resolve_placement(mesh=mesh, data_axes=data_axes, sharding=sharding)


def resolve_device_put(device: Any, mesh: Any, data_axes: Any, sharding: Any) -> DevicePutPlacement:
  """Resolves `device` (or `mesh`/`data_axes`/`sharding`) once, in the caller's thread.

  Unset: `mesh`/`sharding`, else the `jax.set_mesh` mesh, else `default_mesh()`.
  None (also inside a pytree): the default device on one process, as Grain
  places; unset on several, where a global batch spans every host's devices.
  """
  multi = jax.process_count() > 1
  if device is None and not multi:
    if mesh is not None or sharding is not None or data_axes is not None:
      raise ValueError("pass `device`, or `mesh`/`sharding`/`data_axes`, not both")
    return DevicePutPlacement(resolve_placement(), True, None)
  if device is options_lib.UNSET or device is None:
    device = None
  elif not multi and any(x is None for x in _leaves_and_nones(device)):
    # A pytree with the default device for some leaves: placed as it is.
    return DevicePutPlacement(resolve_placement(), True, device)
  if device is None or isinstance(device, _ONE_PLACEMENT):
    one = _resolve_one(device, mesh, data_axes, sharding)
    if isinstance(device, jax.sharding.Mesh):
      # An unbatched element has no row dimension to split: replicate it.
      element: Any = jax.sharding.NamedSharding(device, jax.sharding.PartitionSpec())
    else:
      # As `jax.device_put(element, device)` places it (None: the default device).
      element = device if device is None or isinstance(device, jax.Device) else one.sharding
    return DevicePutPlacement(one, False, element)
  leaves = _leaves_and_nones(device)
  if not leaves or not all(x is None or isinstance(x, _ONE_PLACEMENT) for x in leaves):
    raise ValueError(
      "`device` must be a jax.sharding.Sharding, a jax.sharding.Mesh, a"
      " PartitionSpec, a jax.Device, a pytree of shardings or devices, or None,"
      f" got {type(device).__qualname__}: {device!r:.200}"
    )
  placements = [_resolve_one(x, mesh, data_axes, sharding) for x in leaves]
  shardings = [p.sharding for p in placements]
  if all(x == shardings[0] for x in shardings):
    return DevicePutPlacement(placements[0], False, device)
  if multi:
    raise ValueError(
      f"`device` is a pytree of {len(set(shardings))} different shardings, but"
      f" there are {jax.process_count()} processes; global batches need one"
      " sharding for every leaf (rows split over every process's devices):"
      " pass one jax.sharding.Sharding or a jax.sharding.Mesh"
    )
  return DevicePutPlacement(resolve_placement(), True, device)


def _leaves_and_nones(tree: Any) -> list[Any]:
  """`tree`'s leaves, None included (`jax.tree_util` drops None as an empty node)."""
  return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)
