"""How a sharding's blocks fall on processes, and the shapes that follow.

Along each dimension a sharding splits an array into blocks; `dim_layout`
says which processes hold which blocks (processes that hold the same blocks,
a model axis across processes, form one group and feed the same data).
`local_to_global_shape` and `global_to_local_shape` apply the rule of
`jax.make_array_from_process_local_data` to shapes. Pure functions of the
sharding, cached; no `jax.Array` is made here.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax

from grain_jax_sync._src import meshes


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
  """Where a slice of an index map starts (0 for a whole dimension)."""
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


def _as_sharding(sharding: Any, what: str) -> jax.sharding.Sharding:
  """`sharding` itself, or a mesh as rows over its data axes; raises for anything else."""
  if isinstance(sharding, jax.sharding.Mesh):
    return jax.sharding.NamedSharding(sharding, meshes.data_spec(sharding))
  if isinstance(sharding, jax.sharding.Sharding):
    return sharding
  raise ValueError(
    f"`{what}` must be a jax.sharding.Sharding or a jax.sharding.Mesh, got"
    f" {type(sharding).__qualname__}: {sharding!r:.200}"
  )


def local_to_global_shape(
  local_shape: Sequence[int], sharding: jax.sharding.Sharding | jax.sharding.Mesh
) -> tuple[int, ...]:
  """The global shape of an array built from this process's `local_shape` data.

  The rule of `jax.make_array_from_process_local_data`: along each dimension
  the process holds some blocks of the sharding; the global size is the local
  size times the number of distinct sets of blocks that processes hold.
  Processes that hold the same blocks (a model axis across processes) feed the
  same data and do not add to the global size. A spec longer than the rank is
  cut to it; a `Mesh` means rows over its data axes (``"data"`` or all).

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
  return _local_to_global(_as_sharding(sharding, "sharding"), tuple(local_shape))


@functools.lru_cache(maxsize=1024)
def _local_to_global(
  sharding: jax.sharding.Sharding, local_shape: tuple[int, ...]
) -> tuple[int, ...]:
  s = cut(sharding, len(local_shape))
  pi = jax.process_index()
  out = []
  for dim, size in enumerate(local_shape):
    lay = dim_layout(s, dim, len(local_shape))
    held = len(lay.group_blocks[lay.group_of(pi)])
    if size % held:
      raise ValueError(
        f"dimension {dim} has {size} entries on process {pi}, not divisible by"
        f" the {held} blocks of the sharding that it holds ({s}); expected a"
        f" multiple of {held}"
      )
    out.append(size // held * lay.num_blocks)
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
  s = cut(_as_sharding(sharding, "sharding"), len(global_shape))
  pi = jax.process_index()
  out = []
  for dim, size in enumerate(global_shape):
    lay = dim_layout(s, dim, len(global_shape))
    if size % lay.num_blocks:
      raise ValueError(
        f"dimension {dim} has {size} entries, not divisible by the"
        f" {lay.num_blocks} blocks of the sharding ({s}); expected a multiple of"
        f" {lay.num_blocks}"
      )
    out.append(size // lay.num_blocks * len(lay.group_blocks[lay.group_of(pi)]))
  return tuple(out)
