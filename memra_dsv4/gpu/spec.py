"""Speculative decoding on the GPU: the oracle's draft / verify / commit loop
(``memra_dsv4.oracle.spec.spec_loop``, the one copy of the acceptance rules) driving a
``Dsv4Gpu`` target and, by default, the GPU MTP drafter (gpu.drafters.GpuMtpDrafter).

``speculative_generate(model, prompt, max_new_tokens, k, drafter=None, *, temperature=0.0,
top_p=1.0, generator=None, state=None, schedule=None) -> oracle.spec.SpecResult``
    The oracle function's arguments and result.  The target runs ``Dsv4Gpu.prefill`` /
    ``verify`` (with ``return_streams``: the final streams stay on the last stage's device, the
    MTP drafter's input), ``commit`` and ``decode_step``.  Greedy (temperature 0): every emitted
    token is the argmax of the GPU target's own logits for its position, so the tokens equal
    ``Dsv4Gpu.generate``'s except where a verify row (M = k + 1 GEMM rows) and the one-token step
    differ in the top-1 of a near tie (bf16 class; gpu.verify's module doc).
    ``drafter``: anything with the MtpDrafter interface whose ``propose`` takes the final
    streams (GpuMtpDrafter; a test's scripted drafter).  A drafter that asks for trunk taps
    (DSpark) is refused: this target keeps only the final streams.
Checks before any device work (oracle.spec.check_spec_args / check_spec_room, the same
messages): max_new_tokens, k, temperature / top_p, schedule; the state is this model's; prompt +
max_new_tokens - 1 within its max_seq_len.
"""

from __future__ import annotations

from memra_dsv4.oracle.spec import SpecResult, check_spec_args, check_spec_room, spec_loop

__all__ = ["speculative_generate"]


class _GpuTarget:
    """spec_loop's target on a Dsv4Gpu: rows are the final streams (float32 CuPy)."""

    def __init__(self, model, state):
        self.model, self.state = model, state

    def prefill(self, prompt):
        logits, _, streams = self.model.prefill(prompt, self.state, return_streams=True)
        return logits, streams

    def verify(self, tokens):
        return self.model.verify(self.state, tokens, return_streams=True)

    def commit(self, n: int) -> None:
        self.model.commit(self.state, n)

    def decode_step(self, token):
        return self.model.decode_step(self.state, token)


def speculative_generate(model, prompt, max_new_tokens: int, k: int, drafter=None, *,
                         temperature: float = 0.0, top_p: float = 1.0, generator=None,
                         state=None, schedule=None) -> SpecResult:
    from memra_dsv4.gpu.drafters import GpuMtpDrafter
    drafter = drafter if drafter is not None else GpuMtpDrafter()
    n_new, sampled, probs, generator = check_spec_args(max_new_tokens, k, temperature, top_p,
                                                       generator, drafter, schedule)
    if getattr(drafter, "trunk_taps", None) is not None:
        raise ValueError(f"drafter {type(drafter).__name__} asks for trunk taps (DSpark); the GPU "
                         f"target keeps only the final streams: run it on the oracle")
    ids = model.check_ids(prompt)
    state = model.new_state() if state is None else model._check_state(state)
    check_spec_room(ids.shape[0], n_new, state.max_seq_len)
    return spec_loop(_GpuTarget(model, state), drafter, ids, n_new, k, sampled, probs,
                     generator, schedule)
