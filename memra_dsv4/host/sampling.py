"""Greedy sampling: the next token of a step's logits (the rule the device step's head applies).

Contract
--------
* ``greedy_token(logits) -> int``: the index of the greatest value of a 1-D float array, with
  NumPy's argmax rule: the first occurrence of the maximum, and a NaN counting as greater than
  every number (so the first NaN wins); -0.0 == +0.0 (a tie, the lower index).  Refuses an empty
  or non-1-D array, naming its shape.
* The GPU twin is decode.cu ``greedy_argmax_f32`` (ops_decode.greedy_argmax), the last launch of
  the device step; ``Dsv4Gpu.decode_greedy`` on every other path and the bench's host-fed arms
  apply this function to the returned logits, so both feeds pick the same token from the same
  logits.
* oracle.sampling.greedy is the same rule on the logits a sampler accepts (it refuses NaN, +inf
  and all -inf rows, naming them); this one picks on any float input, as the kernel must, since
  a device-fed step has no host to refuse to.  tests/test_greedy_cpu.py checks they agree where
  both apply.
"""

from __future__ import annotations

import numpy as np

__all__ = ["greedy_token"]


def greedy_token(logits) -> int:
    a = np.asarray(logits)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"greedy_token: logits must be a non-empty 1-D array, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"greedy_token: logits must be floating point, got {a.dtype}")
    return int(np.argmax(a))
