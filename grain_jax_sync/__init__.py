"""grain_jax_sync: per-host batches in, agreed global jax.Arrays out."""

from grain_jax_sync._src.agreement.endings import PeerLostError, PeerTimeoutError
from grain_jax_sync._src.checkpoint import checkpoint_restore, checkpoint_save
from grain_jax_sync._src.compat import jax_sync_generator
from grain_jax_sync._src.grain_dataset import device_put
from grain_jax_sync._src.iterator import JaxBatchIterator, iter_jax_batches
from grain_jax_sync._src.placement import (
  DataShardInfo,
  data_shard_info,
  default_mesh,
  default_sharding,
  global_to_local_shape,
  local_to_global_shape,
)
from grain_jax_sync._src.sources.elastic.mixture import elastic_mixture
from grain_jax_sync._src.sources.elastic.packing import pack_sequences
from grain_jax_sync._src.sources.elastic.source import elastic_source
from grain_jax_sync._src.sources.hugging_face import hf_pipeline
from grain_jax_sync._src.sources.tf_data import from_tf_data
from grain_jax_sync._src.sources.tfds import tfds_pipeline
from grain_jax_sync._src.startup import init_distributed

__version__ = "0.1.0"

__all__ = [
  "DataShardInfo",
  "JaxBatchIterator",
  "PeerLostError",
  "PeerTimeoutError",
  "checkpoint_restore",
  "checkpoint_save",
  "data_shard_info",
  "default_mesh",
  "default_sharding",
  "device_put",
  "elastic_mixture",
  "elastic_source",
  "from_tf_data",
  "global_to_local_shape",
  "hf_pipeline",
  "init_distributed",
  "iter_jax_batches",
  "jax_sync_generator",
  "local_to_global_shape",
  "pack_sequences",
  "tfds_pipeline",
]
