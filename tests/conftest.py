"""Test set-up: 8 forced CPU devices for in-process tests, before JAX starts.

Multi-process tests start their own interpreters through
`grain_jax_sync.testing.run_processes`, which sets their device count.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
