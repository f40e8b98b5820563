"""The process_allgather fallback transport, across real processes."""

import pytest
import scenarios

from grain_jax_sync import testing


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), [(2, 4), (4, 2)])
def test_collective_all_gather_returns_every_payload_in_process_order(n, d):
  outs = testing.values(
    testing.run_processes(
      scenarios.collective_all_gather,
      num_processes=n,
      devices_per_process=d,
      args=(3,),
      timeout_s=180,
    )
  )
  want = [[f"w{w}-p{p}-" + "x" * (p * 7 + w) for p in range(n)] for w in range(3)]
  assert outs == [want] * n
