"""Exact resume of tf.data iterators through TensorFlow's own checkpointing.

A snapshot is TensorFlow's ``SerializeIterator`` output (what
`tf.train.Checkpoint(iterator=it)` saves): a variant tensor that later reads do
not change, costing in proportion to every shuffle buffer slot. It becomes
base64 only when the user asks for the state.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
import zlib
from typing import Any

# The JSON state (`JaxBatchIterator.get_state()`) holds at most this many bytes
# of serialized tf.data iterator state (4/3 of it as base64). Larger states go
# to files through Orbax (`checkpoint_save`), limited only by TensorFlow's
# per-tensor size.
JSON_STATE_LIMIT_BYTES = 1 << 20

KEY = "tf_data_iterator"  # Exported: {KEY: base64, "crc32": c, "reads": n}.

_FIXES = {
  "EagerPyFunc": "a `tf.py_function`",
  "PyFunc": "a `tf.numpy_function` or `Dataset.from_generator`",
}


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """The iterator state after `reads` batches, or why there is none."""

  reads: int
  variant: Any = None  # The ``SerializeIterator`` output (a variant `EagerTensor`).
  error: str | None = None  # Raised by `export`.
  between: bool = False  # No snapshot was due after this batch (`state_every`).


def external_state_policy(dataset: Any) -> int:
  """The dataset's own external state policy, else FAIL (as tf.train.Checkpoint)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  policy = dataset.options().experimental_external_state_policy
  if policy is None:
    policy = tf.data.experimental.ExternalStatePolicy.FAIL
  return policy.value


def take(iterator: Any, policy: int) -> Any:
  """Serializes `iterator`'s state into a variant tensor (TensorFlow errors pass)."""
  from tensorflow.python.ops import gen_dataset_ops  # pylint: disable=g-import-not-at-top

  return gen_dataset_ops.serialize_iterator(
    iterator._iterator_resource,  # pylint: disable=protected-access
    external_state_policy=policy,
  )


def cannot_checkpoint(error: Exception, description: str) -> str:
  """The message for a pipeline that TensorFlow refuses to serialize."""
  found = re.search(r"(\w+) is stateful", str(error))
  op = found.group(1) if found else None
  if op is None:
    what = f"TensorFlow refused to save it ({type(error).__name__}: {str(error).strip()[:300]})"
  else:
    kind = _FIXES.get(op, "a stateful op (e.g. `tf.random.uniform`; use `tf.random.stateless_*`)")
    what = f"it contains the op {op!r}, {kind}, whose state TensorFlow cannot save"
  return (
    f"{description} cannot be checkpointed: {what}. Compute that step with"
    " TensorFlow ops (read files with TFRecordDataset or from_tensor_slices"
    " instead of a Python generator), or use a Grain pipeline. Only if a"
    " resume that is not exact is acceptable, set"
    " `options.experimental_external_state_policy ="
    " tf.data.experimental.ExternalStatePolicy.IGNORE` on the dataset (the"
    " op's own state is then not saved: a generator restarts from its start)"
  )


def export(snapshot: Snapshot, *, limit: int | None) -> dict[str, Any]:
  """The JSON form of `snapshot`, with at most `limit` bytes of state (None: files).

  RuntimeError if the snapshot holds an error, or its state is over `limit`.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  if snapshot.error is not None:
    raise RuntimeError(snapshot.error)
  data = tf.io.serialize_tensor(snapshot.variant).numpy()  # One call for the whole variant.
  check_size(len(data), limit)
  return {
    KEY: base64.b64encode(data).decode("ascii"),
    "crc32": zlib.crc32(data),
    "reads": snapshot.reads,
  }


def check_size(size: int, limit: int | None) -> None:
  if limit is not None and size > limit:
    raise RuntimeError(
      f"the tf.data iterator state is {size} bytes, over the {limit}-byte limit"
      " of the JSON state (get_state()); save it to files with Orbax instead:"
      " `mngr.save(step, args=ocp.args.Composite(data=gjs.checkpoint_save(it)))`"
      " (one file per process, no such limit), or shrink the pipeline's buffers"
      " (shuffle buffer, prefetch)"
    )


def exported_size(state: dict[str, Any]) -> int:
  """Bytes of serialized state in an exported (base64) state."""
  text = state[KEY]
  return len(text) * 3 // 4 - text.count("=", -2)


def restore(iterator: Any, state: Any, description: str) -> int:
  """Restores an exported state into `iterator`; returns its read count.

  ValueError if it does not fit. The CRC32 is checked first: TensorFlow crashes
  the process on some corrupt states.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.python.ops import gen_dataset_ops  # pylint: disable=g-import-not-at-top

  if not (
    isinstance(state, dict)
    and isinstance(state.get(KEY), str)
    and isinstance(state.get("crc32"), int)
    and isinstance(state.get("reads"), int)
  ):
    raise ValueError(
      f"the state for {description} must be a dict with {KEY!r} (base64),"
      f" 'crc32' and 'reads', as get_state() returns it, got {state!r:.200}"
    )
  try:
    data = base64.b64decode(state[KEY], validate=True)
  except binascii.Error as e:
    raise ValueError(f"the saved tf.data state for {description} is not valid base64: {e}") from e
  if zlib.crc32(data) != state["crc32"]:
    raise ValueError(
      f"the saved tf.data state for {description} is corrupt: its {len(data)}"
      f" bytes have CRC32 {zlib.crc32(data)}, the state says {state['crc32']}"
    )
  try:
    variant = tf.io.parse_tensor(data, tf.variant)
    gen_dataset_ops.deserialize_iterator(
      iterator._iterator_resource,  # pylint: disable=protected-access
      variant,
    )
  except (tf.errors.OpError, ValueError) as e:
    raise ValueError(
      f"the saved tf.data state does not fit {description}: {type(e).__name__}:"
      f" {str(e).strip()[:300]}. Restore into the same pipeline (same"
      " transformations and arguments) that saved it, on the same process"
    ) from e
  return int(state["reads"])
