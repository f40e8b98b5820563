"""Elastic resume: records the library splits over processes, resumable on any count.

Modules, each importing only those above it: `source` (`elastic_source`),
`mixture` (`elastic_mixture`: weighted sources read as one elastic source),
`packing` (`pack_sequences`, whose state names its records in flight),
`split` (which records each process reads; re-splitting), `cursor` (the
consumed cursor in a Grain state), `state` (a process's state as JSON),
`stream` (one process's Grain pipeline, `ElasticIterator`), `resume` (every
old process's state -> this process's). The old job's states, taken together,
are the job's state. Grain is imported when a source is opened.
"""

from grain_jax_sync._src.sources.elastic.mixture import elastic_mixture
from grain_jax_sync._src.sources.elastic.packing import pack_sequences
from grain_jax_sync._src.sources.elastic.resume import for_this_process
from grain_jax_sync._src.sources.elastic.source import ElasticSource, elastic_source
from grain_jax_sync._src.sources.elastic.stream import open_stream

__all__ = [
  "ElasticSource",
  "elastic_mixture",
  "elastic_source",
  "for_this_process",
  "open_stream",
  "pack_sequences",
]
