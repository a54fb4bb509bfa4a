r"""Second order, derived by hand: the double backward :func:`sdpa_backward_jvp` and the Hessian-vector product
:func:`sdpa_hvp`.

The backward of attention maps the cotangents ``(dO, dlse)`` to the gradients; its tangent, along the input
tangents and the cotangents' own tangents, is the *double backward* (what ``torch.autograd.grad`` of a gradient
with ``create_graph=True`` computes, or JAX's ``jvp`` of a ``vjp``). With the cotangents held fixed it is the
Hessian-vector product of the loss :math:`\langle dO, O\rangle + \langle dlse, \mathrm{LSE}\rangle`. The formulas
are the plain engine's (:func:`sdpa_ref.attention.backward_jvp`): each line of the backward differentiated by
the product rule, the softmax's step in :func:`sdpa_ref.normalize.vjp_jvp` and softcap's in
:func:`sdpa_ref.transforms.softcap_sech2_jvp`; SEMANTICS.md derives them. With ``precision="reproducible"`` the
same formulas run in double-double (:mod:`sdpa_ref.engines.reproducible_second`), faithfully rounded.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import _validate as V
from . import heads, poison
from .engines import reproducible_second, second
from .engines.contract import Grads
from ._threads import single_threaded_blas
from .api import PRECISIONS, sdpa_forward
from .derivatives import cotangents, input_tangents, sdpa_backward, user_grads
from .score_mod import as_score_mod

__all__ = ["sdpa_backward_jvp", "sdpa_hvp"]

#: Keywords of :func:`sdpa_forward` that choose a schedule second order does not have.
_SCHEDULE = ("save_probs", "num_splits", "split_bounds")
#: The schedules of second order, by ``method=``.
METHODS = ("plain", "tiled")


def sdpa_backward_jvp(primals, tangents, grad_out, grad_out_tangent=None, *, grad_lse=None,
                      grad_lse_tangent=None, method=None, block_size=None, layout=None, precision="fast",
                      **options):
    r"""The double backward: the gradients of attention and their tangent, ``(grads, grads_tangent)``.

    Parameters
    ----------
    primals : tuple
        ``(query, key, value)``; every other input and option is a keyword,
        as in :func:`sdpa_forward`.
    tangents : tuple or mapping
        The inputs' tangents, as :func:`sdpa_jvp` takes them: ``(dquery,
        dkey, dvalue[, dbias[, dsinks[, dqv]]])``, None for zero, or a
        mapping by input name (``{"value": dvalue}``; names ``query``,
        ``key``, ``value``, ``bias``, ``sinks``, ``qv``), every name not
        given a zero tangent. The same bits either way.
    grad_out : array_like, (..., Hq, L, Ev)
        The output's cotangent ``dO``, as :func:`sdpa_backward` takes it.
    grad_out_tangent : array_like, (..., Hq, L, Ev), optional
        Its tangent (None: zero, the Hessian-vector product).
    grad_lse, grad_lse_tangent : array_like, (..., Hq, L), optional
        The LSE's cotangent and its tangent (None: zero).
    method : {"plain", "tiled"}, optional
        The schedule: ``"plain"`` (the default without ``block_size``), the
        plain engine's :func:`sdpa_ref.attention.backward_jvp` on the dense
        problem with ``P`` saved; ``"tiled"`` (the default with
        ``block_size``), :func:`sdpa_ref.engines.second.backward_jvp`, which
        recomputes ``P`` block by block from the tiled forward's row max and
        sum in two sweeps, with no ``L x S`` array. They agree to rounding.
    block_size : int or "auto", optional
        The tiled schedule's block, as in :func:`sdpa_forward`.
    layout : {"bhsd", "bshd"}, Packed or KVCache, optional
        As in :func:`sdpa_forward`; tangents and cotangents in the layout's
        shapes, results in it too.
    precision : {"fast", "reproducible"}, optional
        As in :func:`sdpa_forward`. ``"reproducible"`` (``method`` and
        ``block_size`` then None): both results from the reproducible
        engine, the tangent by
        :func:`sdpa_ref.engines.reproducible_second.backward_jvp`, the plain
        schedule's formulas in double-double with exact products, each
        float64 result faithfully rounded (within one ulp of the exact
        value, with SEMANTICS.md's cancellation exemption) and the same bits
        under every thread count, BLAS and SIMD level.
    **options
        The keyword arguments of :func:`sdpa_forward` that say what is
        computed (masks, bias, softcap, ALiBi, sinks, dropout, ``qv``, the
        policy, a mask function or block mask, a score function with its
        ``grad`` or ``grad2`` and no captured tensor, ...). Not
        ``num_splits``, ``split_bounds`` or ``save_probs``.

    Returns
    -------
    grads : AttentionGrads or AbsorbedGrads
        :func:`sdpa_backward` of the forward of ``method``, the same bits.
    grads_tangent : AttentionGrads or AbsorbedGrads
        The derivative of each gradient along the tangents, in the same
        shapes and dtypes: the Hessian-vector product when
        ``grad_out_tangent`` and ``grad_lse_tangent`` are zero.

    Notes
    -----
    With :math:`\dot x` the tangent of :math:`x` (:math:`\dot P = J\dot T`, the JVP's), each line of the
    backward differentiated by the product rule:

    .. math::

        \dot{dV} &= \dot P_{drop}^T dO + P_{drop}^T \dot{dO}, \qquad
        \dot{dP} = (\dot{dO}\, V^T + dO\, \dot V^T) \odot Z / (1 - p), \\
        \dot{dT} &= P \odot (\dot{dP} - \dot D + \dot{\bar\lambda}) + \dot P \odot (dP - D + \bar\lambda),
        \qquad \dot D = \mathrm{rowsum}(\dot P \odot dP + P \odot \dot{dP}), \\
        \dot{dT}_{raw} &= \dot{dT} \odot \operatorname{sech}^2 - dT \odot \tfrac{2}{c} \tanh(T_{raw}/c)
        \operatorname{sech}^2(T_{raw}/c) \odot \dot T_{raw}, \\
        \dot{dQ} &= s\,(\dot{dT}_{raw} K + dT_{raw} \dot K), \qquad
        \dot{dK} = s\,(\dot{dT}_{raw}^T Q + dT_{raw}^T \dot Q),

    and a sink's :math:`\dot{d\sigma} = \dot p_\sigma(\bar\lambda - D) - p_\sigma \dot D`; the bias's and the
    float mask's are :math:`\dot{dT}` summed to their shapes; GQA sums over the group; the policy's constant
    rows have none. A non-finite input, tangent or cotangent makes NaN every result that its first-order
    reads could reach (:func:`sdpa_ref.poison.backward_taint` with the tangents' poisoned output rows as
    poisoned cotangent rows): never fewer than the results that read it, possibly more.
    """
    return _backward_jvp(primals, tangents, grad_out, grad_out_tangent, grad_lse, grad_lse_tangent, method,
                         block_size, layout, precision, options, True)


def _backward_jvp(primals, tangents, grad_out, grad_out_tangent, grad_lse, grad_lse_tangent, method, block_size,
                  layout, precision, options, want_grads):
    """:func:`sdpa_backward_jvp`; ``want_grads=False`` (:func:`sdpa_hvp`) skips the first-order gradients, which
    the double backward does not read (it reads the forward's residuals and the cotangents): ``(None, tangent)``."""
    if not isinstance(primals, (tuple, list)) or len(primals) != 3:
        raise TypeError(f"`primals` should be a tuple (query, key, value), but got {V.describe(primals)}")
    if not isinstance(tangents, Mapping) and (not isinstance(tangents, (tuple, list)) or
                                              len(tangents) not in (3, 4, 5, 6)):
        raise TypeError("`tangents` should be a tuple (dquery, dkey, dvalue[, dbias[, dsinks[, dqv]]]) or a "
                        f"mapping by input name, but got {V.describe(tangents)}")
    for name in _SCHEDULE:
        if name in options:
            raise TypeError(f"`{name}` should not be given: second order has the plain and tiled schedules in "
                            f"float64 or the inputs' dtype, but got {name}={options[name]!r}")
    V.check_choice(precision, "precision", PRECISIONS)
    exact = precision == "reproducible"
    if exact and (method is not None or block_size is not None):
        raise ValueError("`method` and `block_size` should be None with precision='reproducible' (it has its own "
                         f"engine), but got method={method!r}, block_size={block_size!r}")
    method = method if method is not None else ("plain" if block_size is None else "tiled")
    V.check_choice(method, "method", METHODS)
    if method == "plain" and block_size is not None:
        raise ValueError(f"`block_size` should be None with method='plain', but got {block_size!r}")
    mod = as_score_mod(options.get("score_mod"))
    if mod is not None and mod.params:
        raise ValueError("`score_mod` should capture no tensor for second order (the tangent of their gradient is "
                         f"not computed), but captures {len(mod.params)}")
    schedule = {"precision": precision} if exact else {"method": method, **({} if block_size is None else
                                                                             {"block_size": block_size})}
    _, res = sdpa_forward(*primals, layout=layout, save_probs=True, **dict(options, **schedule))
    prob = res.problem
    grads = sdpa_backward(res, grad_out, grad_lse=grad_lse) if want_grads else None
    dO, do_bad, dlse, dl_bad = cotangents(res, grad_out, grad_lse)
    ddO, ddo_bad, ddlse, ddl_bad = None, None, None, None
    if grad_out_tangent is not None or grad_lse_tangent is not None:
        got = np.zeros(np.shape(grad_out)) if grad_out_tangent is None else grad_out_tangent
        ddO, ddo_bad, ddlse, ddl_bad = cotangents(res, got, grad_lse_tangent,
                                                  names=("grad_out_tangent", "grad_lse_tangent"))
        ddO = None if grad_out_tangent is None else ddO
    (dq, dk, dv, db, ds), (bq, bk, bv, bb, bs), dv_full = input_tangents(res, tangents)
    with single_threaded_blas():
        args = (prob, res.forward, dO, dlse, dq, dk, dv, db, ds, ddO, ddlse)
        if exact:
            gt = reproducible_second.backward_jvp(*args, absorbed=res.absorbed)
        elif method == "plain":
            gt = heads.backward_jvp(*args)
        else:
            gt = second.backward_jvp(*args, block_size=res.block_size)
        jb = poison.jvp_taint(prob, res.taint, (dq, dk, dv, db), (bq, bk, bv, bb), dv_full, ds, bs)
        rows_bad, lse_bad = _union(do_bad, ddo_bad, jb), _union(dl_bad, ddl_bad)
        bad = poison.backward_taint(prob, res.taint, dO, rows_bad, dlse if dlse is not None else ddlse, lse_bad)
    return grads, user_grads(res, gt, bad)


def sdpa_hvp(primals, tangents, grad_out, *, grad_lse=None, method=None, block_size=None, layout=None,
             precision="fast", **options):
    r"""The Hessian-vector product of the loss :math:`\langle dO, O\rangle + \langle dlse, \mathrm{LSE}\rangle`
    along ``tangents``: :func:`sdpa_backward_jvp` with the cotangents held fixed (its ``grads_tangent``).

    Parameters and options are those of :func:`sdpa_backward_jvp`; returns an
    :class:`AttentionGrads` (:class:`AbsorbedGrads` with ``qv``), one entry per input.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 3)) for _ in range(3))
    >>> g, u = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    >>> hv = sdpa_hvp((q, k, v), (u, None, None), g)
    >>> hv.query.shape, float(np.abs(hv.value).max()) > 0
    ((2, 3), True)
    """
    for name in ("grad_out_tangent", "grad_lse_tangent"):
        if name in options:
            raise TypeError(f"`{name}` should not be given to sdpa_hvp (its cotangents are held fixed; the "
                            "double backward with their tangents is sdpa_backward_jvp), but got it")
    return _backward_jvp(primals, tangents, grad_out, None, grad_lse, None, method, block_size, layout, precision,
                         options, False)[1]


def _union(*bads):
    """Where any of ``bads`` (bool arrays of one shape, or None) is True; None when all are None."""
    out = None
    for b in bads:
        if b is not None:
            out = b if out is None else (out | b)
    return out
