"""Elastic resume: records the library splits over processes, resumable on any count.

One package, by concept, each module importing only those above it here:

* `source.py`: `elastic_source` and the `ElasticSource` it returns.
* `split.py`: which records of each epoch each process reads, and
  re-splitting what an old job left (pure; property-tested without JAX).
* `cursor.py`: the consumed cursor found in a Grain iterator's nested state.
* `state.py`: a process's state as JSON (the split history and the cursor),
  checked on restore.
* `stream.py`: `open_stream`, one process's Grain pipeline over its share,
  `ElasticIterator`.
* `resume.py`: `for_this_process`, every old process's state -> this
  process's, on the same or another process count.

The old job's states, taken together, are the job's state: each process's
consumed cursor, exact as of the batch the trainer received, and the history
of splits. Grain is imported when a source is opened.
"""

from grain_jax_sync._src.sources.elastic.resume import for_this_process
from grain_jax_sync._src.sources.elastic.source import ElasticSource, elastic_source
from grain_jax_sync._src.sources.elastic.stream import open_stream

__all__ = ["ElasticSource", "elastic_source", "for_this_process", "open_stream"]
