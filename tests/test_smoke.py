"""The harness itself: real processes, real collectives, bounded time."""

import numpy as np
import pytest
import scenarios

from grain_jax_sync import testing


@pytest.mark.multiprocess
def test_run_iter_two_processes_equal_batches_rows_in_process_order():
  sizes = [[8, 8], [8, 8]]
  outs = testing.values(
    testing.run_processes(
      scenarios.run_iter,
      num_processes=2,
      devices_per_process=4,
      args=(sizes, {"batch_size": 8}),
      timeout_s=120,
    )
  )
  for out in outs:
    assert out["error"] is None
    assert len(out["batches"]) == 2
    for b, batch in enumerate(out["batches"]):
      want = np.concatenate([scenarios.rows_for(p, b, 8) for p in range(2)])
      np.testing.assert_array_equal(batch["x"], want)
