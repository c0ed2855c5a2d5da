"""Helpers of the GPU kernel tests (tests/gpu/test_kernels_*.py): fresh seeds, bf16 data, and
ulp-based comparisons whose failure messages carry the seed and the worst elements.

NumPy only (the tests move arrays to and from the device themselves).  Every random test draws a
fresh seed (``MEMRA_DSV4_TEST_SEED`` pins it) and puts it in every assertion message, so a
failure can be replayed bit for bit.
"""

from __future__ import annotations

import os
import time

import numpy as np

from memra_dsv4.formats import decode_bf16, encode_bf16

__all__ = ["fresh_seed", "rng_for", "bf16", "rand_bf16", "bits_of", "ulp_bf16", "ulp_dist_bf16",
           "ulp_dist_f32", "assert_bf16", "assert_f32", "assert_within", "describe", "snapshot_diff",
           "assert_arms_agree", "eager_step_launches", "env_arm_runner", "attr_arm_runner", "arm_attrs_now", "step_forms",
           "max_active_clusters"]


def fresh_seed() -> int:
    """A new seed per call (time and os.urandom) unless MEMRA_DSV4_TEST_SEED is set."""
    pinned = os.environ.get("MEMRA_DSV4_TEST_SEED", "")
    if pinned:
        return int(pinned)
    return int.from_bytes(os.urandom(4), "little") ^ (time.time_ns() & 0xFFFFFFFF)


def rng_for(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def bf16(x) -> np.ndarray:
    """float -> float32 on the bf16 grid (RNE)."""
    return decode_bf16(encode_bf16(np.asarray(x, dtype=np.float32)))


def bits_of(x) -> np.ndarray:
    """bf16-valued float32 -> uint16 bits (exact; asserts the values are on the grid)."""
    x = np.asarray(x, dtype=np.float32)
    b = encode_bf16(x)
    assert np.array_equal(decode_bf16(b).view(np.uint32), x.view(np.uint32)), "bits_of: value not on the bf16 grid"
    return b


def rand_bf16(rng, shape, scale: float = 1.0, spread: int = 0) -> np.ndarray:
    """bf16-valued float32 normal(0, scale) data; spread > 0 multiplies by 2^U(-spread, spread)."""
    x = rng.standard_normal(shape).astype(np.float64) * scale
    if spread:
        x = x * np.exp2(rng.integers(-spread, spread + 1, size=shape))
    return bf16(x.astype(np.float32))


def ulp_bf16(x) -> np.ndarray:
    """Spacing of the bf16 grid at |x| (2^-133 for subnormals/zero)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.where(a >= 2.0 ** -126, np.exp2(e - 7), 2.0 ** -133)


def _ordered(u: np.ndarray, sign: int) -> np.ndarray:
    u = u.astype(np.int64)
    return np.where(u & sign, -(u & (sign - 1)), u)


def ulp_dist_bf16(a_bits, b_bits) -> np.ndarray:
    """|ordinal distance| between bf16 bit patterns (+0 and -0 are equal)."""
    return np.abs(_ordered(np.asarray(a_bits, np.uint16), 0x8000) - _ordered(np.asarray(b_bits, np.uint16), 0x8000))


def ulp_dist_f32(a, b) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    b = np.ascontiguousarray(b, dtype=np.float32).view(np.uint32)
    return np.abs(_ordered(a, 0x80000000) - _ordered(b, 0x80000000))


def describe(seed: int, **ctx) -> str:
    items = ", ".join(f"{k}={v}" for k, v in ctx.items())
    return f"[seed={seed}{', ' + items if items else ''}; rerun with MEMRA_DSV4_TEST_SEED={seed}]"


def _worst(dist, got, want, n=5) -> str:
    flat = np.argsort(dist.reshape(-1))[::-1][:n]
    rows = []
    for f in flat:
        idx = np.unravel_index(f, dist.shape)
        rows.append(f"{tuple(int(i) for i in idx)}: got {got[idx]!r} want {want[idx]!r} ({int(dist[idx])} ulp)")
    return "\n    ".join(rows)


def assert_bf16(got_bits, want, what: str, seed: int, *, max_ulp: int = 0, max_frac: float = 0.0, **ctx):
    """got (uint16 bits) vs want (bf16-valued float32, or bits): every element within max_ulp,
    and at most max_frac of the elements differing at all."""
    got_bits = np.asarray(got_bits, dtype=np.uint16)
    want_bits = np.asarray(want) if np.asarray(want).dtype == np.uint16 else encode_bf16(np.asarray(want, np.float32))
    assert got_bits.shape == want_bits.shape, f"{what}: shape {got_bits.shape} != {want_bits.shape}"
    gnan, wnan = np.isnan(decode_bf16(got_bits)), np.isnan(decode_bf16(want_bits))
    assert np.array_equal(gnan, wnan), f"{what}: NaN pattern differs {describe(seed, **ctx)}"
    dist = np.where(gnan, 0, ulp_dist_bf16(got_bits, want_bits))
    n_diff = int((dist > 0).sum())
    bad = dist > max_ulp
    frac = n_diff / max(1, dist.size)
    if bad.any() or frac > max_frac:
        g, w = decode_bf16(got_bits), decode_bf16(want_bits)
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements beyond {max_ulp} bf16 ulp, {n_diff}/{dist.size} differ "
            f"(allowed fraction {max_frac}) {describe(seed, **ctx)}\n    {_worst(dist, g, w)}")
    return n_diff


def assert_f32(got, want, what: str, seed: int, *, max_ulp: int = 0, max_frac: float = 1.0, **ctx):
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    both_nan = np.isnan(got) & np.isnan(want)
    dist = np.where(both_nan, 0, ulp_dist_f32(got, want))
    n_diff = int((dist > 0).sum())
    bad = dist > max_ulp
    if bad.any() or n_diff / max(1, dist.size) > max_frac:
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements beyond {max_ulp} f32 ulp, {n_diff}/{dist.size} differ "
            f"{describe(seed, **ctx)}\n    {_worst(dist, got, want)}")
    return n_diff


def assert_within(got, want, bound, what: str, seed: int, **ctx):
    """|got - want| <= bound elementwise (float64 comparison; bound broadcasts)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    err = np.abs(got - want)
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), err.shape)
    bad = ~(err <= bound)
    if bad.any():
        ratio = np.where(bound > 0, err / np.where(bound > 0, bound, 1), np.inf)
        flat = np.argsort(np.where(np.isfinite(ratio), ratio, 1e300).reshape(-1))[::-1][:5]
        rows = []
        for f in flat:
            idx = np.unravel_index(f, err.shape)
            rows.append(f"{tuple(int(i) for i in idx)}: got {got[idx]!r} want {want[idx]!r} "
                        f"|err| {err[idx]:.3e} bound {bound[idx]:.3e}")
        raise AssertionError(f"{what}: {int(bad.sum())}/{err.size} elements out of bound "
                             f"{describe(seed, **ctx)}\n    " + "\n    ".join(rows))


def snapshot_diff(ref: dict, other: dict) -> list:
    """The keys of ``ref`` (a DecodeState.snapshot(): name -> array) whose arrays are not equal
    in ``other``, in ref's order: the step tests' "every cache byte" comparison of two arms."""
    return [k for k in ref if not np.array_equal(np.asarray(ref[k]), np.asarray(other[k]))]


def assert_arms_agree(tag: str, states: dict, tokens, run, *, pos0: int = 0) -> None:
    """The step tests' A/B identity check.  ``states``: arm name -> DecodeState, the first arm the
    reference.  For each token (token-major: every arm takes token i before any takes i + 1),
    ``run(arm, i, token)`` steps that arm and returns its logits; every arm's logits must equal
    the reference's bit for bit (as uint32), and at the end every arm's snapshot must equal the
    reference's (snapshot_diff: every cache byte)."""
    arms = list(states)
    ref = arms[0]
    for i, t in enumerate(tokens):
        got = {a: np.asarray(run(a, i, t)) for a in arms}
        for a in arms[1:]:
            assert np.array_equal(got[a].view(np.uint32), got[ref].view(np.uint32)), \
                f"{tag}: step {i} (pos {pos0 + i}): logits of {a} differ from {ref}'s"
    snap = states[ref].snapshot()
    for a in arms[1:]:
        diff = snapshot_diff(snap, states[a].snapshot())
        assert not diff, f"{tag}: caches of {a} differ from {ref}'s: {diff}"


def eager_step_launches(m, state, t) -> tuple:
    """One eager device step of ``state`` with token ``t``, recorded launch by launch: (its
    logits, the launched kernels' names in launch order, module prefix dropped)."""
    from memra_dsv4.gpu.step import device_step
    from memra_dsv4.profiling.launches import record_launches
    out = []
    recs = record_launches(lambda: out.append(device_step(m, state, int(t), graph=False)), ("step_device.py",))
    return out[0], [r.kernel.split(".", 1)[1] for r in recs]


def env_arm_runner(m, states: dict, env: str, arms: dict, monkeypatch, first_eager=None):
    """``run`` for assert_arms_agree where an arm is (value of the env variable ``env``, graph):
    the variable is set, then the device step runs that arm's state (graph replay or eager).
    ``first_eager(a, t)``, if given, takes the first step of every eager arm instead, with the
    variable already set (a test's launch-recording check; it returns the logits)."""
    def run(a, i, t):
        from memra_dsv4.gpu.step import device_step
        value, graph = arms[a]
        monkeypatch.setenv(env, value)
        if first_eager is not None and i == 0 and not graph:
            return first_eager(a, t)
        return device_step(m, states[a], int(t), graph=graph)
    return run


def attr_arm_runner(m, states: dict, arms: dict, first_eager=None):
    """``run`` for assert_arms_agree where an arm is ({model attribute: value}, graph): the
    attributes are set, then the device step runs that arm's state (graph replay or eager).
    ``first_eager(a, t)``, if given, takes the first step of every eager arm instead (a test's
    launch-recording check; it sets the attributes it needs and returns the logits).  Restore the
    attributes with ``step_forms(m, **arm_attrs_now(m, arms))`` around the check.  An attribute
    that some arm names and another does not takes, in the other, its value from when the runner
    was made (not the previous arm's)."""
    base = arm_attrs_now(m, arms)

    def run(a, i, t):
        from memra_dsv4.gpu.step import device_step
        attrs, graph = arms[a]
        for k, v0 in base.items():
            setattr(m, k, attrs.get(k, v0))
        if first_eager is not None and i == 0 and not graph:
            return first_eager(a, t)
        return device_step(m, states[a], int(t), graph=graph)
    return run


def arm_attrs_now(m, arms: dict) -> dict:
    """The model's current value of every attribute an arm of ``arms`` (attr_arm_runner's form)
    names: ``step_forms(m, **arm_attrs_now(m, arms))`` puts them back after the check."""
    return {k: getattr(m, k) for attrs, _ in arms.values() for k in attrs}


class step_forms:
    """``with step_forms(m, decode_fork="all", hc_split="on"):`` sets model attributes for the
    block (the graph-branch forms a switch needs present) and restores them after."""

    def __init__(self, m, **forms) -> None:
        self.m, self.forms = m, forms

    def __enter__(self):
        self.old = {k: getattr(self.m, k) for k in self.forms}
        for k, v in self.forms.items():
            setattr(self.m, k, v)
        return self.m

    def __exit__(self, *exc) -> None:
        for k, v in self.old.items():
            setattr(self.m, k, v)


def max_active_clusters(kern, ctas: int, block: int, shared_mem: int) -> int:
    """cuOccupancyMaxActiveClusters of a one-cluster launch of ``kern`` (a kernel_loader kernel:
    its ``.kernel.ptr`` is the CUfunction) as (ctas,) CTAs of ``block`` threads with
    ``shared_mem`` dynamic bytes, the cluster (ctas, 1, 1); a cluster of more than 8 CTAs is
    first allowed on the function (non-portable).  Asserts each driver call succeeds.  The
    cluster kernels' occupancy tests (router_cluster_*, hc_boundary_pre_cluster) use it."""
    from cuda.bindings import driver as cu
    func = cu.CUfunction(int(kern.kernel.ptr))
    err, = cu.cuFuncSetAttribute(func, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = ctas, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes = shared_mem
    ca = cu.CUlaunchAttribute()
    ca.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    ca.value.clusterDim.x, ca.value.clusterDim.y, ca.value.clusterDim.z = ctas, 1, 1
    cfg.attrs = [ca]
    cfg.numAttrs = 1
    err, n = cu.cuOccupancyMaxActiveClusters(func, cfg)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return n
