"""The NumPy oracle of DeepSeek-V4-Flash: the arithmetic contract of the GPU runtime.

``Oracle(ckpt, numerics=...)`` (prefill, mtp_forward) lives in ``memra_dsv4.oracle.model``;
the primitives the GPU kernels mirror in ``memra_dsv4.oracle.ops``; the numeric classes in
``memra_dsv4.seams``.  See docs/semantics.md.

Decode (``memra_dsv4.oracle.decode``, ``state``): ``oracle.new_state()``, ``prefill_state``,
``decode_step``, ``prefill_chunk``, ``verify`` / ``commit``.  Speculative decoding
(``memra_dsv4.oracle.spec``): the MTP drafter (``new_mtp_state``, ``mtp_propose``),
``speculative_generate``, ``greedy_generate``.  Sampling (``memra_dsv4.oracle.sampling``):
``sample``, ``sampling_probs``, ``spec_accept``.
"""

from memra_dsv4.oracle.model import ForwardOut, MtpOut, Oracle, check_token_ids
from memra_dsv4.oracle.decode import MAX_DRAFT, StepOut
from memra_dsv4.oracle.sampling import sample, sampling_probs, spec_accept
from memra_dsv4.oracle.spec import (MtpDraft, MtpDrafter, SpecResult, greedy_generate,
                                    speculative_generate)
from memra_dsv4.oracle.state import DEFAULT_MAX_SEQ_LEN, DecodeState, LayerCache

__all__ = ["Oracle", "ForwardOut", "MtpOut", "check_token_ids",
           "DecodeState", "LayerCache", "StepOut", "MAX_DRAFT", "DEFAULT_MAX_SEQ_LEN",
           "MtpDraft", "MtpDrafter", "SpecResult", "speculative_generate", "greedy_generate",
           "sample", "sampling_probs", "spec_accept"]
