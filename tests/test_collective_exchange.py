"""The process_allgather fallback transport, across real processes."""

import pytest

from grain_jax_sync import testing


def collective_all_gather(windows: int) -> list[list[str]]:
  """In each process: gathers payloads of a different length per process and window."""
  import jax

  from grain_jax_sync._src.exchange import collective

  p = jax.process_index()
  ex = collective.CollectiveExchange(process_index=p, process_count=jax.process_count())
  return [ex.all_gather(w, f"w{w}-p{p}-" + "x" * (p * 7 + w)) for w in range(windows)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "d"), [(2, 4), (4, 2)])
def test_collective_all_gather_returns_every_payload_in_process_order(n, d):
  outs = testing.values(
    testing.run_processes(
      collective_all_gather, num_processes=n, devices_per_process=d, args=(3,), timeout_s=180
    )
  )
  want = [[f"w{w}-p{p}-" + "x" * (p * 7 + w) for p in range(n)] for w in range(3)]
  assert outs == [want] * n
