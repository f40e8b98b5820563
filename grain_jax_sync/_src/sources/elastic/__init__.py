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
