"""The liveness times the beat, the exchange and the agreement's core share."""

# The liveness period: one beat per process, and the longest a wait (for a
# read, in the store) lasts before the core looks at its peers' beats again;
# a shorter one would only add wakes (`liveness`, `exchange`).
LIVENESS_PERIOD_S = 1.0
# A live process misses this much of beats only if its interpreter is frozen
# (SIGSTOP, swapping), which a busy training loop is not: then it is dead.
DEAD_AFTER_S = 8.0
