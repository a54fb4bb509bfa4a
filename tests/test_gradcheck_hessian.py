"""check_hvp: Hessian-vector products against finite differences of the VJP, and the wrong ones it must catch."""

import numpy as np
import pytest

import sdpa_ref as sr

RNG = np.random.default_rng(3)
X = RNG.standard_normal((3, 5))
A, B = RNG.standard_normal((4, 4)), RNG.standard_normal((4, 4))


# softmax along the last axis: y = softmax(x), the VJP g -> y (g - <g, y>), and its derivative along v:
# dy = y (v - <v, y>), d(VJP) = dy (g - <g, y>) - y <g, dy>
def softmax_vjp(g, x):
    y = sr.softmax(x)
    return (y * (g - np.sum(g * y, axis=-1, keepdims=True)),)


def softmax_hvp(g, ts, x, *, missing=False, sign=1.0):
    (v,) = ts
    y = sr.softmax(x)
    dy = y * (v - np.sum(v * y, axis=-1, keepdims=True))
    out = dy * (g - np.sum(g * y, axis=-1, keepdims=True))
    if not missing:
        out = out - sign * y * np.sum(g * dy, axis=-1, keepdims=True)
    return (out,)


# tanh(A B): Z = A B, Y = tanh Z, dZ = g (1 - Y^2); gradients (dZ B^T, A^T dZ); along (vA, vB):
# dY = (1 - Y^2)(vA B + A vB), dZ' = -2 g Y dY, H v = (dZ' B^T + dZ vB^T, vA^T dZ + A^T dZ')
def tanh_mm(a, b):
    return np.tanh(a @ b)


def tanh_mm_vjp(g, a, b):
    y = np.tanh(a @ b)
    dz = g * (1 - y * y)
    return dz @ b.T, a.T @ dz


def tanh_mm_hvp(g, ts, a, b, *, wrong=None):
    va, vb = ts
    y = np.tanh(a @ b)
    dz = g * (1 - y * y)
    dy = (1 - y * y) * (va @ b + a @ vb)
    dz2 = (2.0 if wrong == "sign" else -2.0) * g * y * dy
    ha = dz2 @ b.T + (0.0 if wrong == "missing" else dz @ vb.T)
    hb = dz.T @ va if wrong == "transposed" else va.T @ dz             # transposed: (vA^T dZ)^T in its place
    return ha, hb + a.T @ dz2


@pytest.mark.parametrize("mode", ["full", "projection"])
def test_right_hvps_pass(mode):
    rep = sr.check_hvp(sr.softmax, softmax_vjp, softmax_hvp, (X,), mode=mode)
    assert rep.ok and rep.kind == "check_hvp" and rep.max_rel_error < 1e-7, rep
    assert any("symmetric" in n for n in rep.notes)
    rep = sr.check_hvp(tanh_mm, tanh_mm_vjp, tanh_mm_hvp, (A, B), mode=mode)
    assert rep.ok and rep.max_rel_error < 1e-7, rep


@pytest.mark.parametrize("mode", ["full", "projection"])
@pytest.mark.parametrize("wrong", [
    lambda g, ts, x: softmax_hvp(g, ts, x, missing=True),                 # the -y <g, dy> term forgotten
    lambda g, ts, x: softmax_hvp(g, ts, x, sign=-1.0),                    # its sign flipped
], ids=["softmax-missing-term", "softmax-wrong-sign"])
def test_wrong_softmax_hvps_are_caught(mode, wrong):
    rep = sr.check_hvp(sr.softmax, softmax_vjp, wrong, (X,), mode=mode)
    assert not rep.ok, rep
    with pytest.raises(AssertionError, match="check_hvp"):
        sr.assert_hvp(sr.softmax, softmax_vjp, wrong, (X,), mode=mode)


@pytest.mark.parametrize("wrong", ["sign", "missing", "transposed"])
def test_wrong_product_hvps_are_caught_and_located(wrong):
    rep = sr.check_hvp(tanh_mm, tanh_mm_vjp, lambda g, ts, a, b: tanh_mm_hvp(g, ts, a, b, wrong=wrong), (A, B))
    assert not rep.ok, rep
    note = next(n for n in rep.notes if n.startswith("the worst entry is of the gradient of arg"))
    blamed = int(note.split("arg ")[1].split(" ")[0])
    assert blamed == {"sign": blamed, "missing": 0, "transposed": 1}[wrong], rep


def test_the_symmetry_probe_catches_a_transposed_block_without_differences():
    # a "VJP" x -> M x with a non-symmetric M is no gradient of anything, and its "HVP" v -> M v agrees with its
    # differences entry by entry: only the symmetry probe can tell (fun gives the output's shape, nothing more)
    M = RNG.standard_normal((6, 6))

    def fun(x):
        return 0.5 * x @ (M @ x)

    def vjp(g, x):
        return (g * (M @ x),)

    def hvp(g, ts, x):
        return (g * (M @ ts[0]),)

    x = RNG.standard_normal(6)
    rep = sr.check_hvp(fun, vjp, hvp, (x,), cotangent=np.array(1.0))
    assert not rep.ok and any(n.startswith("not symmetric") for n in rep.notes), rep
    assert rep.per_arg[0]["failed"] == 0       # the differences alone agree: only the symmetry caught it
    sym = sr.check_hvp(fun, lambda g, x: (g * ((M + M.T) / 2) @ x,), lambda g, ts, x: (g * ((M + M.T) / 2) @ ts[0],),
                       (x,), cotangent=np.array(1.0))
    assert sym.ok, sym


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="`cotangent` should have the output's shape"):
        sr.check_hvp(sr.softmax, softmax_vjp, softmax_hvp, (X,), cotangent=np.ones(3))
    with pytest.raises(ValueError, match="`hvp` should return 1 gradients"):
        sr.check_hvp(sr.softmax, softmax_vjp, lambda g, ts, x: (x, x), (X,))
    with pytest.raises(ValueError, match="`hvp` gradient 0 should have shape"):
        sr.check_hvp(sr.softmax, softmax_vjp, lambda g, ts, x: (x[0],), (X,))
    with pytest.raises(TypeError, match="`symmetry` should be a bool"):
        sr.check_hvp(sr.softmax, softmax_vjp, softmax_hvp, (X,), symmetry="yes")
    with pytest.raises(ValueError, match="mode"):
        sr.check_hvp(sr.softmax, softmax_vjp, softmax_hvp, (X,), mode="half")


def test_the_callers_arrays_are_not_touched():
    x = X.copy()
    sr.check_hvp(sr.softmax, softmax_vjp, softmax_hvp, (x,))
    assert np.array_equal(x, X)


def test_symmetry_is_checked_on_the_finite_rows_when_some_are_nan():
    """A NaN row makes <u, H v> NaN on both sides; the check must then look at the finite rows, not pass."""
    A = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])          # not symmetric in rows 0 and 1

    def fun(x):
        return np.array([x @ x])

    def vjp(g, x):
        r = g[0] * (A @ x)
        r[2] = np.nan
        return [r]

    def hvp(g, t, x):
        r = g[0] * (A @ t[0])
        r[2] = np.nan
        return [r]

    rep = sr.check_hvp(fun, vjp, hvp, [np.array([0.3, -0.7, 0.2])], cotangent=np.array([1.0]))
    assert not rep.ok and any(n.startswith("not symmetric") for n in rep.notes), str(rep)
    S = (A + A.T) / 2
    rep = sr.check_hvp(fun, lambda g, x: [np.r_[(g[0] * (S @ x))[:2], np.nan]],
                    lambda g, t, x: [np.r_[(g[0] * (S @ t[0]))[:2], np.nan]], [np.array([0.3, -0.7, 0.2])],
                    cotangent=np.array([1.0]), mode="projection")
    assert any("on the 2 of 3 rows of H that are finite" in n for n in rep.notes), str(rep)
