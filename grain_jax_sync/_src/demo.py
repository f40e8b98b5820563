"""The demo job: simulated hosts with uneven shards, agreed global batches.

Host p reads 10 + 7 * p records, so the hosts run out at different times; the
iterator pads short batches and gives exhausted hosts masked dummy batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def host_records(process: int, batch_size: int) -> list[dict[str, np.ndarray]]:
  """This host's shard: ids 1000 * process + i, batched by `batch_size`."""
  n = 10 + 7 * process
  ids = 1000 * process + np.arange(n, dtype=np.int32)
  feats = np.stack([ids, ids * 2], axis=1).astype(np.float32)
  return [
    {"id": ids[i : i + batch_size], "features": feats[i : i + batch_size]}
    for i in range(0, n, batch_size)
  ]


def expected_batches(processes: int, batch_size: int) -> int:
  """Global batches every host yields: the longest host's batch count."""
  return max(len(host_records(p, batch_size)) for p in range(processes))


def demo_host(batch_size: int, progress_file: str) -> list[dict[str, Any]]:
  """Runs in every simulated host; returns one line of facts per batch, then
  the resume state, the iterator's `stats()` and its `stats(all_hosts=True)`."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  import grain_jax_sync as gjs  # pylint: disable=g-import-not-at-top

  p = jax.process_index()
  source = host_records(p, batch_size)
  rows = []
  with gjs.iter_jax_batches(
    source,
    batch_size=batch_size,
    paddings={"id": -1, "features": 0.0},
    mask_key="mask",
    dtypes={"features": "bfloat16"},
  ) as it:
    for i, batch in enumerate(it):
      mask = np.asarray(multihost_utils.process_allgather(batch["mask"], tiled=True))
      ids = np.asarray(multihost_utils.process_allgather(batch["id"], tiled=True))
      local_real = int(sum(np.asarray(s.data).sum() for s in batch["mask"].addressable_shards))
      rows.append(
        {
          "batch": i,
          "global_shape": tuple(batch["id"].shape),
          "features_dtype": str(batch["features"].dtype),
          "local_real_rows": local_real,
          "local_padded_rows": batch_size - local_real,
          "global_mask_sum": int(mask.sum()),
          "real_ids": sorted(int(x) for x in ids[mask]),
        }
      )
      with open(progress_file, "a", encoding="utf-8") as f:  # A byte a batch, for the progress bar.
        f.write(".")
    rows += [{"state": it.get_state()}, {"stats": it.stats()}]
    # Every host's counters, as this one sees them, once every host ended:
    # each posts its figures at its end, after its last batch.
    multihost_utils.sync_global_devices("grain_jax_sync demo: every host ended")
    rows.append({"job": it.stats(all_hosts=True)})
  return rows
