"""The NumPy oracle of DeepSeek-V4-Flash: the arithmetic contract of the GPU runtime.

``Oracle(ckpt, numerics=...)`` (prefill, mtp_forward) lives in ``memra_dsv4.oracle.model``;
the primitives the GPU kernels mirror in ``memra_dsv4.oracle.ops``; the numeric classes in
``memra_dsv4.seams``.  See docs/semantics.md.
"""

from memra_dsv4.oracle.model import ForwardOut, MtpOut, Oracle, check_token_ids

__all__ = ["Oracle", "ForwardOut", "MtpOut", "check_token_ids"]
