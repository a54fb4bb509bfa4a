r"""What reads what: where the inputs were not finite, and the arithmetic that says which results read them.

The contract (``SEMANTICS.md``, "Excluded positions are never read"): a NaN
or inf in an input reaches exactly the results that read it, as NaN, and
every other result keeps the bits it has with clean memory. Two steps, the
same for every engine and precision:

1. :func:`scrub` (from :meth:`sdpa_ref.problem.Problem.build`): the problem's
   own copies hold 0 wherever an input is not finite (``-inf`` in a float
   mask or bias is an exclusion and stays), and :class:`Poison` records
   where. Every engine computes on that clean memory.
2. Which results read a poisoned entry is not modelled here a second time:
   it is *computed*, by running the dense schedule
   (:mod:`sdpa_ref.engines.reproducible`) -- the same stage definitions,
   allowed set and policy as every engine -- over :class:`ReadsArith`, an
   arithmetic whose every value carries, beside its value on the clean
   memory, where it reads a poisoned input (``t``) and where it is a
   *structural* zero (``z``): an entry that the allowed set, the policy or
   dropout makes 0 whatever any input holds. Then

   ========================  =====================================================
   operation                 reads poison where
   ========================  =====================================================
   ``a + b``, ``a - b``      either does (0 only where both are structural zeros)
   ``a * b``                 either does, unless the other is a structural zero
   ``a / b``                 either does, unless ``a`` is a structural zero
   ``exp``, ``log``, ...     its argument does
   ``where(c, a, b)``        the branch taken does
   ``sum`` over an axis      a term does
   ``A @ B``                 some ``A_ij B_jk`` with a poisoned factor and no
                             structural zero
   ========================  =====================================================

   so a masked ``P_ij = 0`` never lets ``v_j`` through (``0 * NaN`` would in
   IEEE arithmetic), while every entry that does enter a sum does. A new
   stage or layout written over an arithmetic needs no code here.

Then :func:`nan_where` sets what reads poison to NaN. A poisoned result is
NaN whole: where IEEE arithmetic would give ``inf`` (``P_ij * inf`` with
``P_ij > 0``) the reference says NaN too; it promises which results are
poisoned, not which non-finite value they hold. On finite input this costs
one ``isfinite`` pass over each input and nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import numpy as np

from .arith import NUMPY
from .transforms import softcap_sech2

__all__ = ["Poison", "Reads", "ReadsArith", "clean", "lift_problem", "nan_where", "scrub"]


class Poison(NamedTuple):
    """Where the problem's inputs were not finite (each broadcastable to its own array, or None where all were)."""

    q: Optional[np.ndarray]         # (..., Hkv, G, L, 1): a non-finite entry in the query row
    k: Optional[np.ndarray]         # (..., Hkv, S, 1)
    v: Optional[np.ndarray]         # (..., Hkv, S, Ev), element-wise (the values every row reads, cleaned alike)
    mask: Optional[np.ndarray]      # the float mask's own shape: NaN or +inf
    bias: Optional[np.ndarray]      # the bias's own shape: NaN or +inf
    alibi: Optional[np.ndarray]     # (..., Hq, 1, 1)


def scrub(a, *, additive=False, rows=False):
    """Set the non-finite entries of the writable ``a`` to 0 and say where they were (None if nowhere).

    ``additive``: ``-inf`` (an exclusion) is kept and not reported. ``rows``: report per row (any over the
    last axis, the axis kept).
    """
    if a is None or _all_finite(a):
        return None
    bad = ~np.isfinite(a)
    if additive:
        bad &= ~(np.isreal(a) & (a.real == -np.inf))
    if not bad.any():
        return None
    a[bad] = 0
    return bad.any(axis=-1, keepdims=True) if rows else bad


def clean(a):
    """``(a with its non-finite entries set to 0, where they were)``; ``a`` itself and None when all are finite."""
    if a is None or _all_finite(a):
        return a, None
    ok = np.isfinite(a)
    return np.where(ok, a, a.dtype.type(0)), ~ok


def nan_where(x, bad):
    """``x`` with NaN where ``bad`` (a new array), or ``x`` itself when ``bad`` is None."""
    return x if bad is None else np.where(bad, x.dtype.type(np.nan), x)


#: Entries up to which :func:`_all_finite` tests each one (a small bool temporary; a call's fixed cost is what
#: counts there), and past which it sums them instead (no temporary; one pass).
_SMALL = 1 << 16


def _all_finite(a):
    """Every entry finite: one reduction, no temporary (a sum of finite values that overflows is checked again);
    on small arrays the entries themselves, which costs a third of the sum's floating-point-state guard."""
    if a.size <= _SMALL:
        return bool(np.isfinite(a).all())
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.sum(a)):
            return True
    return bool(np.isfinite(a).all())


# ------------------------------------------------------------ the values


_HANDLED = {}


def _implements(fn):
    def register(impl):
        _HANDLED[fn] = impl
        return impl
    return register


class Reads:
    """A value of :class:`ReadsArith`: ``v`` (the value on clean memory), ``t`` (bool: reads a poisoned input) and ``z``
    (bool: a structural zero), all of one shape (``t`` implies not ``z``).

    It slices, reshapes and broadcasts as an ndarray does (``x[ix]``, ``x.reshape``, ``np.swapaxes``,
    ``np.broadcast_to``, ``np.where``), so the schedules' layout code runs on it unchanged; NumPy's ufuncs are
    refused, so that no arithmetic bypasses :class:`ReadsArith`. ``==`` compares the values.
    """

    __slots__ = ("v", "t", "z")
    __array_ufunc__ = None

    def __init__(self, v, t=None, z=None):
        v = np.asarray(v)
        self.v, self.t, self.z = v, _full_bool(t, v.shape), _full_bool(z, v.shape)

    shape = property(lambda self: self.v.shape)
    ndim = property(lambda self: self.v.ndim)
    size = property(lambda self: self.v.size)
    dtype = property(lambda self: self.v.dtype)

    def _map(self, f):
        return Reads(f(self.v), f(self.t), f(self.z))

    def __getitem__(self, ix):
        return self._map(lambda a: a[ix])

    def __setitem__(self, ix, other):
        o = other if isinstance(other, Reads) else Reads(other)
        self.v[ix], self.t[ix], self.z[ix] = o.v, o.t, o.z

    def reshape(self, *shape):
        return self._map(lambda a: a.reshape(*shape))

    def swapaxes(self, a1, a2):
        return self._map(lambda a: np.swapaxes(a, a1, a2))

    def __eq__(self, other):
        return self.v == other

    def __neg__(self):
        return Reads(-self.v, self.t, self.z)

    __hash__ = None

    def __array_function__(self, func, types, args, kwargs):
        impl = _HANDLED.get(func)
        if impl is None:
            return NotImplemented
        return impl(*args, **kwargs)


def _full_bool(x, shape):
    """``x`` (None: False) as a bool array of ``shape``: itself when it has it, else a broadcast (read-only) view."""
    if x is None:
        return np.zeros(shape, bool)
    if isinstance(x, np.ndarray) and x.shape == shape and x.dtype == bool:
        return x
    return np.broadcast_to(np.asarray(x, bool), shape)


def _parts(x):
    """``(v, t, z)`` of a Reads value or of a plain array: a constant of the schedule (a fill, an ALiBi distance,
    a zero tangent; every input is lifted), which reads nothing. It is no structural zero even where it is 0: a
    structural zero is made on purpose, by :meth:`ReadsArith.const` in a ``where`` (the allowed set, the policy's
    constant rows) or by dropout; ``slope * 0`` on ALiBi's diagonal still reads the slope, as a kernel does."""
    if isinstance(x, Reads):
        return x.v, x.t, x.z
    x = np.asarray(x)
    return x, np.zeros(x.shape, bool), np.zeros(x.shape, bool)


@_implements(np.where)
def _where(cond, a, b):
    (av, at, az), (bv, bt, bz) = _parts(a), _parts(b)
    return Reads(np.where(cond, av, bv), np.where(cond, at, bt), np.where(cond, az, bz))


@_implements(np.broadcast_to)
def _broadcast_to(x, shape, subok=False):
    return x._map(lambda a: np.broadcast_to(a, shape))


@_implements(np.swapaxes)
def _swapaxes(x, a1, a2):
    return x.swapaxes(a1, a2)


@_implements(np.shape)
def _shape(x):
    return x.shape


@_implements(np.ndim)
def _ndim(x):
    return x.ndim


# ------------------------------------------------------------ the arithmetic


class ReadsArith:
    """The arithmetic of reads (:class:`Reads` values): the value as NumPy computes it on clean memory, and
    where it reads poison and where it is a structural zero, by the rules of the module docstring.

    It has the interface of :mod:`sdpa_ref.exact.arith`, so the dense schedule runs on it unchanged; it never
    raises where those raise on an overflow (the values are only the structure: which scores are ``-inf``,
    which rows have no key), and :meth:`result` is a value's ``t``.
    """

    #: The schedule raises on an unasked-for NaN in the other arithmetics; here values are structure only.
    checks = False

    def __init__(self, dtype=np.float64):
        self.dtype = np.dtype(dtype)

    # -- storage
    def empty(self, shape):
        return Reads(np.empty(shape, self.dtype), np.zeros(shape, bool), np.zeros(shape, bool))

    def at(self, a, ix):
        return a[ix]

    def put(self, dst, ix, v):
        dst[ix] = v

    def const(self, x):
        return Reads(np.asarray(x, self.dtype), False, x == 0)

    def recip(self, n):
        """``1/n`` for positive ``n`` (a count, or an array of counts): a constant, which reads nothing."""
        return self.const(1.0 / np.asarray(n, np.float64))

    def value(self, a):
        return a.v if isinstance(a, Reads) else a

    def result(self, a):
        """Where a result reads poison (bool)."""
        return np.array(_parts(a)[1])

    def lift(self, x):
        return x if isinstance(x, Reads) else Reads(*_parts(x))

    def reshape(self, a, shape):
        return a.reshape(shape)

    # -- element-wise
    @staticmethod
    def _join(v, t, z):
        return Reads(v, t & ~z, z)

    def add(self, a, b):
        (av, at, az), (bv, bt, bz) = _parts(a), _parts(b)
        return Reads(av + bv, at | bt, az & bz)

    def sub(self, a, b):
        (av, at, az), (bv, bt, bz) = _parts(a), _parts(b)
        return Reads(av - bv, at | bt, az & bz)

    def mul(self, a, b):
        (av, at, az), (bv, bt, bz) = _parts(a), _parts(b)
        z = az | bz
        return self._join(av * bv, at | bt, z)

    def div(self, a, b):
        (av, at, az), (bv, bt, _) = _parts(a), _parts(b)
        return self._join(av / bv, at | bt, az)

    add_d, mul_d = add, mul

    def neg(self, a):
        return -self.lift(a)

    def _of(self, f, a, keeps_zero=False):
        v, t, z = _parts(a)
        return Reads(f(v), t, z if keeps_zero else None)

    def elementwise(self, f, a):
        """A NumPy element-wise map ``f`` (a score function): each entry reads what its argument reads."""
        return self._of(f, a)

    def exp(self, a):
        return self._of(np.exp, a)

    def log(self, a):
        return self._of(np.log, a)

    def tanh(self, a):
        return self._of(np.tanh, a, keeps_zero=True)

    def exp_minus(self, a, m):
        d = self.sub(a, m)
        return Reads(np.exp(d.v), d.t, None)

    def clamp(self, a, limit):
        return self._of(lambda v: np.clip(v, -limit, limit), a, keeps_zero=True)

    def sech2(self, x, t):
        v, tt, _ = _parts(x)
        return Reads(softcap_sech2(v, 1.0), tt, None)

    exact_product = mul

    def where(self, cond, a, b):
        return _where(cond, a, b)

    def take(self, a, idx):
        return self.lift(a)._map(lambda x: np.take_along_axis(x, idx, -1))

    def div_masked(self, x, keep, a, b):
        """``x * Z / (a + b)`` (the value as :data:`sdpa_ref.arith.NUMPY` computes it): an entry ``Z`` drops is a
        structural zero."""
        v, t, z = _parts(x)
        return self._join(NUMPY.div_masked(v, keep, a, b), t, z | ~np.asarray(keep))

    # -- reductions and products
    def row_max(self, T, excluded):
        """``(m, empty, over)`` as the other arithmetics give them (``over`` never: nothing raises here); ``m``
        reads what some allowed entry of its row reads."""
        v, t, _ = _parts(T)
        x = v if excluded is None else np.where(excluded, -np.inf, v)
        if excluded is not None:
            t = t & ~excluded
        m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
        empty = m == -np.inf
        m = np.where(np.isfinite(m), m, 0).astype(self.dtype)
        return Reads(m, np.any(t, axis=-1, keepdims=True), None), empty, np.zeros(m.shape, bool)

    def sum(self, a, axis=-1, keepdims=False):
        v, t, z = _parts(a)
        return Reads(np.sum(v, axis=axis, keepdims=keepdims), np.any(t, axis=axis, keepdims=keepdims),
                     np.all(z, axis=axis, keepdims=keepdims))

    def matmul(self, A, B, final=False, scale=None, spans=None, contract=None):
        """``A @ B`` (times ``scale``): an entry reads poison where some term ``A_ij B_jk`` has a poisoned factor
        and no structural zero, and is a structural zero where every term has one; with ``spans`` (the columns
        each row wants, :func:`sdpa_ref.exact.ozaki.matmul`), an entry outside them is a structural zero that
        reads nothing (the arithmetics leave it ``+0``; a block may form more, which this does not count).
        ``contract`` (where each row of ``A`` may be nonzero) leaves out terms whose ``A`` factor is a structural
        zero, which this reads as nothing already."""
        (av, at, az), (bv, bt, bz) = _parts(A), _parts(B)
        v = av @ bv if scale is None else (av @ bv) * scale
        ones = None                                          # the products of 0/1 indicators, only where needed
        if av.shape[-1] and not az.any() and not bz.any():
            z = np.zeros(v.shape, bool)                      # no term is a structural zero
        else:
            na, nb = (~az).astype(np.float32), (~bz).astype(np.float32)
            ones, z = (na, nb), (na @ nb) == 0
        t = np.zeros(v.shape, bool)
        if at.any():                                         # A_ij poisoned, B_jk no structural zero
            t |= (at.any(axis=-1, keepdims=True) if ones is None else (at.astype(np.float32) @ ones[1]) > 0)
        if bt.any():                                         # B_jk poisoned, A_ij no structural zero
            t |= (bt.any(axis=-2, keepdims=True) if ones is None else (ones[0] @ bt.astype(np.float32)) > 0)
        if spans is not None:
            j = np.arange(v.shape[-1])
            out = (j < spans[0][:, None]) | (j >= spans[1][:, None])          # (M, N): not formed
            v, t, z = np.where(out, v.dtype.type(0), v), t & ~out, z | out
        return self._join(v, t, z)


def lift_problem(prob, poison=None):
    """``(problem, arithmetic)``: ``prob`` with its inputs as :class:`Reads` values that read poison where
    ``poison`` (default: ``prob.poison``) says, and the :class:`ReadsArith` of its compute dtype (the real one
    of a complex problem: the structure is the real parts')."""
    p = prob.poison if poison is None else poison
    p = p if p is not None else Poison(None, None, None, None, None, None)

    def up(a, bad):
        if a is None:
            return None
        return Reads(a.real if np.iscomplexobj(a) else a, bad, None)

    v = up(prob.v, p.v)
    v_full = None if prob.v_full is None else (v if prob.v_full is prob.v else up(prob.v_full, p.v))
    lifted = dataclasses.replace(prob, q=up(prob.q, p.q), k=up(prob.k, p.k), v=v, v_full=v_full,
                                 mask_float=up(prob.mask_float, p.mask), bias=up(prob.bias, p.bias),
                                 alibi=up(prob.alibi, p.alibi))
    return lifted, ReadsArith(np.dtype(prob.dtype).type(0).real.dtype)
