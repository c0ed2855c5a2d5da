"""Speculative decoding on the GPU: the oracle's draft / verify / commit loop
(``memra_dsv4.oracle.spec.spec_loop``, the one copy of the acceptance rules) driving a
``Dsv4Gpu`` target and, by default, the GPU MTP drafter (gpu.drafters.GpuMtpDrafter).

``speculative_generate(model, prompt, max_new_tokens, k, drafter=None, *, temperature=0.0,
top_p=1.0, generator=None, state=None, schedule=None) -> oracle.spec.SpecResult``
    The oracle function's arguments and result.  The target runs ``Dsv4Gpu.prefill`` /
    ``verify`` (with ``return_streams``: the final streams stay on the last stage's device, the
    MTP drafter's input; for a drafter with ``trunk_taps`` (DSpark), ``taps=`` those trunk
    layers' output streams instead, [m, n_taps, hc, dim]), ``commit`` and ``decode_step``.  Greedy (temperature 0): every emitted
    token is the argmax of the GPU target's own logits for its position, so the tokens equal
    ``Dsv4Gpu.generate``'s except where a verify row (M = k + 1 GEMM rows) and the one-token step
    differ in the top-1 of a near tie (bf16 class; gpu.verify's module doc).
    ``drafter``: anything with the drafter interface of oracle.spec (GpuMtpDrafter,
    gpu.dspark.GpuDSparkDrafter, a test's scripted drafter); None: the checkpoint's own, the MTP
    or the DSpark drafter by the config's drafter kind (the model loaded with drafter=True).
Checks before any device work (oracle.spec.check_spec_args / check_spec_room, the same
messages): max_new_tokens, k, temperature / top_p, schedule; the state is this model's; prompt +
max_new_tokens - 1 within its max_seq_len.
"""

from __future__ import annotations

from memra_dsv4.oracle.spec import SpecResult, check_spec_args, check_spec_room, spec_loop

__all__ = ["default_drafter", "speculative_generate"]


class _GpuTarget:
    """spec_loop's target on a Dsv4Gpu: rows are the final streams, or with ``taps`` those trunk
    layers' output streams (float32 CuPy on the last stage's device)."""

    def __init__(self, model, state, taps=()):
        self.model, self.state, self.taps = model, state, taps

    def prefill(self, prompt):
        logits, _, streams = self.model.prefill(prompt, self.state, return_streams=True,
                                                taps=self.taps)
        return logits, streams

    def verify(self, tokens):
        return self.model.verify(self.state, tokens, return_streams=True, taps=self.taps)

    def commit(self, n: int) -> None:
        self.model.commit(self.state, n)

    def decode_step(self, token):
        return self.model.decode_step(self.state, token)


def speculative_generate(model, prompt, max_new_tokens: int, k: int, drafter=None, *,
                         temperature: float = 0.0, top_p: float = 1.0, generator=None,
                         state=None, schedule=None) -> SpecResult:
    drafter = drafter if drafter is not None else default_drafter(model)
    n_new, sampled, probs, generator = check_spec_args(max_new_tokens, k, temperature, top_p,
                                                       generator, drafter, schedule)
    taps_of = getattr(drafter, "trunk_taps", None)
    taps = model.check_taps(taps_of(model), True) if taps_of is not None else ()
    ids = model.check_ids(prompt)
    state = model.new_state() if state is None else model._check_state(state)
    check_spec_room(ids.shape[0], n_new, state.max_seq_len)
    return spec_loop(_GpuTarget(model, state, taps), drafter, ids, n_new, k, sampled, probs,
                     generator, schedule)


def default_drafter(model):
    """The GPU drafter of the model's checkpoint: GpuDSparkDrafter for a DSpark config, else
    GpuMtpDrafter (whose begin refuses a model without a drafter, naming the fix)."""
    from memra_dsv4.config import DRAFTER_DSPARK
    if model.config.drafter_kind == DRAFTER_DSPARK:
        from memra_dsv4.gpu.dspark import GpuDSparkDrafter
        return GpuDSparkDrafter()
    from memra_dsv4.gpu.drafters import GpuMtpDrafter
    return GpuMtpDrafter()
