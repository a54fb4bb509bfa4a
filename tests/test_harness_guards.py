"""Guarded copies (sdpa_ref/harness/guards.py) and the harness's guarded runs: what reads outside its inputs.

Evidence: a guarded copy has the input's shape, dtype and values, stride 1 on its last axis, and guard elements
before, after and between its rows and heads at every test dtype; a read one row before or after it, or one row
past each head, reads the fill only; writes there are seen by ``guard_intact``. In the quick suite, a kernel that
reads one row past the end of K (as a view one row longer, the extra key "masked" by adding -inf to its score,
which hides any finite garbage) fails with "reads outside its inputs", in process and isolated, and so does one
that reads one row past each head's keys; a kernel that writes past them fails with "writes outside its inputs";
honest kernels (the specimens, the reference, a kernel that copies its inputs to contiguous memory first, the
layouts) conform with no guard row; a kernel that refuses strided inputs gets a guard skip, not a failure.
"""

import hostile_impls
import numpy as np
import pytest

from sdpa_ref import check_implementation, sdpa_backward, sdpa_forward
from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.guards import FILLS, HUGE, GuardBroken, guard_fill, guard_intact, guard_value, guarded
from sdpa_ref.harness.lowp import TEST_DTYPES, as_test_dtype

QUICK = get_suite("quick")
#: a few quick cases: plain, GQA, causal, a bias, lengths
CASES = [c for c in QUICK if any(w in c.name for w in ("plain", "gqa", "bias", "len"))][:8]


def _guard_rows(rep):
    return [r for r in rep.rows if r.quantity == "guard"]


# -- the guarded copy


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("shape", [(), (5,), (3, 7), (2, 3, 5, 4), (0, 4)])
def test_a_guarded_copy_holds_the_values_in_a_fenced_strided_view(dtype, fill, shape):
    dt = as_test_dtype(dtype, "dtype")
    a = (np.arange(int(np.prod(shape))) % 7 - 3).reshape(shape).astype(dt)
    g = guarded(a, fill)
    assert g.shape == a.shape and g.dtype == a.dtype and g.tobytes() == a.tobytes()
    assert guard_fill(g) == fill and guard_intact(g)
    assert guard_fill(a) is None and guard_fill(g.copy()) is None
    if g.ndim:
        assert g.strides[-1] == dt.itemsize
        assert g.ctypes.data % 64 == 0 and all(s % 64 == 0 for s in g.strides[:-1])
    if g.ndim >= 2 and g.size:
        assert not g.flags.c_contiguous                        # rows apart: a guard between each two
    if g.ndim >= 2 and g.size:                                 # a row before the first, after the last
        want = np.array([guard_value(dt, fill)], dt).astype(np.float64)
        first = g.ctypes.data - g.base.ctypes.data
        last = first + sum((n - 1) * st for n, st in zip(g.shape[:-1], g.strides[:-1]))
        for off in (first - g.strides[-2], last + g.strides[-2]):
            got = np.ndarray(g.shape[-1:], dt, buffer=g.base, offset=off, strides=g.strides[-1:]).astype(np.float64)
            assert (np.isnan(got) if fill == "nan" else got == want).all()


def test_one_row_past_each_block_of_a_guarded_copy_is_guard():
    g = guarded(np.ones((2, 3, 5, 4)), "nan")
    past = np.lib.stride_tricks.as_strided(g, (2, 3, 6, 4), g.strides)[..., -1, :]     # row 5 of every head
    assert np.isnan(past).all()
    assert np.isnan(np.lib.stride_tricks.as_strided(g, (2, 3, 5, 5), g.strides)[..., -1]).all()   # a column past


def test_the_huge_fill_is_finite_and_large_at_every_dtype():
    for name in TEST_DTYPES:
        dt = as_test_dtype(name, "dtype")
        val = float(np.array([guard_value(dt, "huge")], dt).astype(np.float64)[0])
        assert np.isfinite(val) and val >= 100 and val <= HUGE


def test_guard_intact_sees_a_write_outside():
    g = guarded(np.zeros((3, 4), np.float32), "nan")
    np.lib.stride_tricks.as_strided(g, (4, 4), g.strides)[3, 0] = 1.0                 # one row past the end
    assert not guard_intact(g)
    h = guarded(np.zeros((3, 4), np.float32), "huge")
    np.lib.stride_tricks.as_strided(h, (3, 5), h.strides)[1, 4] = np.nan                # between two rows
    assert not guard_intact(h)
    k = guarded(np.zeros((3, 4), np.float32), "nan")
    k[...] = 7.0                                                                        # inside: allowed
    assert guard_intact(k)


def test_guarded_refuses_what_it_cannot_guard():
    with pytest.raises(TypeError, match="`array` should be a floating-point array, but got .*int64"):
        guarded(np.arange(3))
    with pytest.raises(TypeError, match="bool"):
        guarded(np.ones(3, bool))
    with pytest.raises(ValueError, match="`fill` should be one of"):
        guarded(np.ones(3), fill="zero")
    with pytest.raises(ValueError, match="`array` should be an array made by guarded()"):
        guard_intact(np.ones(3))
    with pytest.raises(ValueError, match="made by guarded"):
        guard_intact(guarded(np.ones((2, 3)))[0])                # a view of one is not one


def test_guarded_does_not_mutate_its_input():
    a = np.arange(12.0).reshape(3, 4)
    a.setflags(write=False)
    g = guarded(a, "huge")
    assert (a == np.arange(12.0).reshape(3, 4)).all() and (g == a).all() and g.flags.writeable


# -- kernels that read or write outside their inputs, and honest ones


def _reference(q, k, v, **o):
    return sdpa_forward(q, k, v, **o)[0]


def _with_key(q, k, v, kx, **o):
    """The reference's output, plus one more key ``kx`` (``(..., Hkv, 1, E)``) "masked" by adding -inf to its
    score (value 0): nothing while ``kx`` is finite, NaN where it is not. A kernel that loads a tile past the
    end and masks it by addition does this."""
    out = sdpa_forward(q, k, v, **o)[0]
    rep = q.shape[-3] // kx.shape[-3]
    kx = np.repeat(kx, rep, axis=-3).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = q.astype(np.float64) @ np.swapaxes(kx, -1, -2)
        return (out + 0.0 * np.exp(s - np.inf)).astype(out.dtype)


def reads_past_k(q, k, v, **o):
    """A view over K's memory one row longer; its last row, past the end of K, is an extra key."""
    longer = np.lib.stride_tricks.as_strided(k, k.shape[:-2] + (k.shape[-2] + 1, k.shape[-1]), k.strides)
    return _with_key(q, k, v, longer[..., -1:, :], **o)


def _row_past_each_head(k):
    """Row S of each head's keys through K's own strides (on contiguous memory the next head's row 0, inside K),
    ``(..., Hkv, 1, E)``; the last head takes its own last row instead, so that nothing past K is read."""
    longer = np.lib.stride_tricks.as_strided(k, k.shape[:-2] + (k.shape[-2] + 1, k.shape[-1]), k.strides)
    past = longer[..., -1:, :].reshape((-1, 1, k.shape[-1]))
    own = k[..., -1:, :].reshape((-1, 1, k.shape[-1]))
    return np.concatenate([past[:-1], own[-1:]]).reshape(k.shape[:-2] + (1, k.shape[-1]))


def reads_past_each_head(q, k, v, **o):
    """Reads row S of each head's keys as an extra key "masked" by adding -inf: exact without guards."""
    return _with_key(q, k, v, _row_past_each_head(k), **o)


def drops_nan(q, k, v, **o):
    """Reads row S of each head's keys as an extra key of value 0 whose score is lowered by 60 (its weight is
    below float32's rounding while its score is of order 1) and a NaN score taken as masked (as a kernel does
    whose masking is ``fmax`` or ``nan_to_num``): NaN guards leave it exact, huge ones do not."""
    out, res = sdpa_forward(q, k, v, **o)
    kx = np.repeat(_row_past_each_head(k), q.shape[-3] // k.shape[-3], axis=-3).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = (q.astype(np.float64) @ np.swapaxes(kx, -1, -2))[..., 0] / np.sqrt(q.shape[-1]) - 60.0
        s = np.nan_to_num(s, nan=-np.inf)
        p = 1.0 / (1.0 + np.exp(res.lse - s))                   # the extra key's share of its row
    return (out * (1.0 - p)[..., None]).astype(out.dtype)


def writes_past_k(q, k, v, **o):
    """The reference, then a write into the row past the end of each head's keys but the last (in range on
    contiguous memory: the next head's first row, already used)."""
    out = _reference(q, k, v, **o)
    if k.ndim >= 3 and np.prod(k.shape[:-2]) > 1:
        longer = np.lib.stride_tricks.as_strided(k, k.shape[:-2] + (k.shape[-2] + 1, k.shape[-1]), k.strides)
        longer[(0,) * (k.ndim - 2) + (-1,)] = 0                     # head 0's row S
    return out


def contiguous_first(q, k, v, **o):
    """An honest kernel that copies its inputs to contiguous memory first (the guards are dropped)."""
    q, k, v = (np.ascontiguousarray(x) for x in (q, k, v))
    return _reference(q, k, v, **o)


def refuses_strided(q, k, v, **o):
    if not all(x.flags.c_contiguous for x in (q, k, v)):
        raise ValueError("inputs must be contiguous")
    return _reference(q, k, v, **o)


def _reference_backward(g, q, k, v, **o):
    gr = sdpa_backward(sdpa_forward(q, k, v, **o)[1], g)
    return (gr.query, gr.key, gr.value) + ((gr.bias,) if gr.bias is not None else ())


@pytest.mark.parametrize("isolate", [False, True])
def test_a_kernel_reading_one_row_past_the_end_of_k_fails_the_quick_suite(isolate):
    rep = check_implementation(reads_past_k, isolate=isolate)
    guard = _guard_rows(rep)
    assert not rep.ok and guard and all(r.status == "FAIL" for r in guard)
    assert all("reads outside its inputs" in r.note for r in guard)
    assert "the NaN guards' run's forward" in guard[0].note
    assert {r.case for r in guard} == {c.name for c in QUICK}                # every case catches it
    assert "reads outside its inputs" in str(rep)


def test_reads_past_each_head_conform_without_guards_and_fail_with_them():
    assert check_implementation(reads_past_each_head, cases=CASES, dtypes=("float32", "float16"),
                                guards=False).ok
    rep = check_implementation(reads_past_each_head, cases=CASES, dtypes=("float32", "float16"))
    guard = _guard_rows(rep)
    assert not rep.ok and {r.status for r in rep.rows if r.quantity != "guard"} == {"pass"}
    assert {r.quantity for r in rep.failures} == {"guard"} and all("reads outside" in r.note for r in guard)


def test_huge_guards_catch_what_nan_guards_miss():
    assert check_implementation(drops_nan, cases=CASES, guards=False).ok
    rep = check_implementation(drops_nan, cases=CASES)
    guard = _guard_rows(rep)
    assert not rep.ok and guard and all("the huge guards' run's forward" in r.note for r in guard)
    assert all(f"with {HUGE:g} before, after and between its rows" in r.note for r in guard)


@pytest.mark.parametrize("isolate", [False, True])
def test_a_kernel_writing_outside_its_inputs_fails(isolate):
    rep = check_implementation(writes_past_k, cases=CASES, isolate=isolate)
    guard = _guard_rows(rep)
    assert not rep.ok and guard and all("writes outside its inputs" in r.note and "`key`" in r.note
                                        for r in guard)


def test_the_backward_runs_on_guarded_inputs():
    def backward_reads_past_k(g, q, k, v, **o):
        res = list(_reference_backward(g, q, k, v, **o))
        longer = np.lib.stride_tricks.as_strided(k, k.shape[:-2] + (k.shape[-2] + 1, k.shape[-1]), k.strides)
        res[0] = res[0] + 0.0 * np.sum(longer[..., -1:, :], axis=(-2, -1), keepdims=True).astype(res[0].dtype)
        return tuple(res)

    rep = check_implementation(_reference, backward=backward_reads_past_k, cases=CASES[:3])
    guard = _guard_rows(rep)
    assert guard and all("the NaN guards' run's backward" in r.note and "dq changed" in r.note for r in guard)


@pytest.mark.parametrize("layout", ["bhld", "blhd", "thd", "paged"])
def test_honest_kernels_add_no_guard_row(layout):
    import test_harness_storage as storage

    fwd, bwd = {"bhld": (contiguous_first, None), "blhd": (hostile_impls.honest_blhd, None),
                "thd": (storage.varlen, storage.varlen_bwd), "paged": (storage.paged, storage.paged_bwd)}[layout]
    rep = check_implementation(fwd, backward=bwd, layout=layout, dtypes=("float32", "float16"))
    assert rep.ok and not _guard_rows(rep) and rep.meta["guards"] is True, rep


def test_a_kernel_refusing_strided_inputs_gets_a_guard_skip():
    rep = check_implementation(refuses_strided, cases=CASES)
    guard = _guard_rows(rep)
    assert rep.ok and guard and all(r.status == "skip" and "raised on strided inputs" in r.note for r in guard)


def test_guards_false_runs_no_guarded_call():
    calls = []

    def counts(q, k, v, **o):
        calls.append(guard_fill(k))
        return _reference(q, k, v, **o)

    check_implementation(counts, cases=CASES[:2], guards=False)
    assert calls == [None, None]
    calls.clear()
    check_implementation(counts, cases=CASES[:2])
    assert calls == [None, "nan", "huge"] * 2
    with pytest.raises(TypeError, match="`guards`"):
        check_implementation(counts, cases=CASES[:1], guards="yes")


def test_guard_broken_names_the_inputs():
    assert "`key`, `value`" in str(GuardBroken(["key", "value"]))
