"""Elastic resume: records the library splits over processes, resumable on any count.

`source` (`elastic_source`), `mixture` (`elastic_mixture`), `packing`
(`pack_sequences`), `split` (who reads what; re-splitting), `cursor`, `state`,
`stream` (`ElasticIterator`), `resume` (every old process's state -> this
process's). The old job's states, taken together, are the job's state.
"""
