r"""The derivatives of attention: :func:`sdpa_backward` (reverse mode, from the residuals of
:func:`sdpa_ref.sdpa_forward`) and :func:`sdpa_jvp` (forward mode).

Each validates the cotangents or tangents, cleans them as the primals were cleaned (0 where no result reads
them, and where they are not finite, :mod:`sdpa_ref.poison`), runs the engine's ``backward`` or ``jvp`` with
the BLAS held to one thread, and returns the results in the inputs' shapes and dtypes. The derivations are in
the docstrings below, in :mod:`sdpa_ref.attention` and in SEMANTICS.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import _validate as V
from . import poison
from ._threads import single_threaded_blas
from .api import METHODS, Engine, sdpa_forward
from .engines import blocks
from .normalize import extra_shape
from .reads import clean
from .residuals import AbsorbedGrads, AttentionGrads, AttentionResiduals, ScoreModGrads
from .rounding import round_to
from .transforms import unbroadcast

__all__ = ["BACKWARD_METHODS", "AbsorbedGrads", "AttentionGrads", "cotangents", "input_tangents", "sdpa_backward",
           "sdpa_jvp", "user_grads"]

#: Accepted values of ``sdpa_backward(..., method=)``: the engines, and two older names
#: (``"probs"`` is ``"fast"``, ``"lse"`` is ``"tiled"``: FlashAttention's recomputing backward).
BACKWARD_METHODS = METHODS + ("probs", "lse", "reproducible")
_ALIASES = {"probs": "fast", "lse": "tiled", "split": "tiled"}      # the split schedule's backward is tiled's


def sdpa_backward(residuals, grad_out, method=None, *, grad_lse=None):
    r"""Gradients of attention by the hand-derived backward.

    Parameters
    ----------
    residuals : AttentionResiduals
        From :func:`sdpa_forward`.
    grad_out : array_like, (..., Hq, L, Ev)
        Cotangent ``dO`` of the output (any input dtype of the forward).
    method : {"fast", "plain", "tiled", "split", "probs", "lse"}, optional
        The engine; by default the one that made the residuals (``"split"``'s
        backward is ``"tiled"``'s, from the merged row max and sum). ``"fast"``
        and ``"plain"`` read the saved ``P`` (``"fast"`` in place, with
        :math:`D = \mathrm{rowsum}(dO \odot O)`; ``"plain"``, the teaching
        form, with :math:`D = \mathrm{rowsum}(P \odot dP)`). ``"tiled"`` is
        FlashAttention's: it keeps only ``(O, lse)`` (with the row max and sum
        apart) and recomputes :math:`P = e^{T - m} / s` block by block (for
        dense residuals, four blocks of rows with every key, so that it peaks
        below the default). ``"probs"`` and ``"lse"`` are the older names of
        ``"fast"`` and ``"tiled"``. They agree to rounding.
    grad_lse : array_like, (..., Hq, L), optional
        Cotangent of the LSE (``residuals.lse``, natural base), for a loss
        that reads it (FlashAttention 4's ``dlse``, FlexAttention's LSE
        gradient, a merge of split results). None (default) is zero and
        costs nothing. Not read on rows whose LSE is a constant: no allowed
        key, or padded.

    Returns
    -------
    AttentionGrads
        ``(query, key, value, attn_mask, bias, sinks)``, and ``qv`` last
        (the subclass :class:`AbsorbedGrads`) when the forward took ``qv``,
        then ``score_mod`` (:class:`ScoreModGrads`) when its score function
        captures tensors; each summed back to its input's shape (broadcast
        batch dims, a broadcast mask, the GQA group) and cast to its input's
        dtype; None where there is no such input (``grads.qv`` and
        ``grads.score_mod`` read None on every record without them).

    Notes
    -----
    Reverse through :math:`O = P_{drop} V`: :math:`dV = P_{drop}^T dO` and
    :math:`dP_{drop} = dO\,V^T`. Dropout is element-wise,
    :math:`dP = dP_{drop} \odot Z / (1 - p)`.

    Each row of :math:`P` is a softmax of :math:`T_i`, whose Jacobian is
    :math:`\operatorname{diag}(P_i) - P_i P_i^T`, so

    .. math::

        dT_i = P_i \odot (dP_i - D_i), \qquad D_i = \sum_j P_{ij}\, dP_{ij}.

    :math:`D_i = \sum_j P_{drop,ij} (dO_i \cdot v_j) = dO_i \cdot O_i` too, so
    ``D`` needs no ``L x S`` product (FlashAttention's identity).

    With ``grad_lse`` :math:`\bar\lambda`: :math:`\partial\,\mathrm{lse}_i /
    \partial T_{ij} = e^{T_{ij}} / \sum_k e^{T_{ik}} = P_{ij}` (the undropped
    :math:`P`), so :math:`dT_i = P_i \odot (dP_i - D_i + \bar\lambda_i)`;
    FlashAttention 4 folds it into :math:`D` as :math:`D_i - \bar\lambda_i`.

    Masked entries have :math:`P_{ij} = 0` and so :math:`dT_{ij} = 0`. The
    float mask, the bias and ALiBi are added to :math:`T`, so
    :math:`dB = dT`. Softcap :math:`T = c \tanh(T_{raw}/c)` gives
    :math:`dT_{raw} = dT \odot (1 - \tanh^2(T_{raw}/c))`. Finally
    :math:`T_{raw} = s\,Q K^T` gives :math:`dQ = s\, dT_{raw} K` and
    :math:`dK = s\, dT_{raw}^T Q`, summed over the query heads of a GQA group.

    Fully masked rows: under ``"zero"`` :math:`P_i = 0`, so every
    contribution of the row is 0. Under ``"uniform"`` the row's
    probabilities do not depend on the scores, so :math:`dT_i = 0` while
    :math:`dV` receives :math:`dO_i / S` from it. Under ``"nan"`` the
    formulas are evaluated as written in IEEE arithmetic: :math:`dQ_i` and
    :math:`dB_i` are NaN, and so are :math:`dK` and :math:`dV` of the kv
    head it reads (the textbook / xformers behaviour). Padded query rows
    (``i >= q_len``) have :math:`P_i = 0` under every policy.
    """
    if not isinstance(residuals, AttentionResiduals):
        raise TypeError("`residuals` should be the AttentionResiduals returned by sdpa_forward, "
                        f"but got {V.describe(residuals)}")
    prob = residuals.problem
    V.check_choice(method if method is not None else residuals.method, "method", BACKWARD_METHODS)
    name = _ALIASES.get(method if method is not None else residuals.method, method or residuals.method)
    if (name == "reproducible") != (residuals.method == "reproducible"):
        raise ValueError("`method` should be None or 'reproducible' for residuals of precision='reproducible', "
                         "and 'reproducible' only for those, but got "
                         f"method={method!r} for residuals of method {residuals.method!r}")
    if name == "reproducible" and residuals.forward.extra is None:
        raise ValueError("`residuals` of precision='reproducible' need save_probs=True for the backward "
                         "(it has no recomputing form)")
    if name != "tiled" and residuals.probs is None:
        if method is not None:
            raise ValueError("`method` should be 'tiled' (or 'lse') for residuals saved with save_probs=False "
                             f"or by the tiled engine, but got {method!r}")
        name = "tiled"
    dO, do_bad, dlse, dl_bad = cotangents(residuals, grad_out, grad_lse)
    engine = Engine(name, (residuals.block_size or blocks.lse_blocks(prob.L, prob.S)) if name == "tiled" else None)
    with single_threaded_blas():
        gr = engine.backward(prob, residuals.forward, dO, dlse, absorbed=residuals.absorbed)
        bad = poison.backward_taint(prob, residuals.taint, dO, do_bad, dlse, dl_bad)   # what reads poison: NaN
    return user_grads(residuals, gr, bad)


def cotangents(residuals, grad_out, grad_lse, names=("grad_out", "grad_lse")):
    """``(dO, where not finite, dlse, where not finite)``: ``grad_out`` and ``grad_lse`` (None: zero) checked
    against the forward's output and LSE (``names`` for the messages), gathered from a layout, and cleaned as
    the problem cleans its inputs (:meth:`sdpa_ref.problem.Problem.clean_grad_out`)."""
    prob, lay = residuals.problem, residuals.layout
    g = V.as_float_array(grad_out, names[0])
    want = prob.out_shape if lay is None else lay.out_shape
    if g.shape != want:
        raise ValueError(f"`{names[0]}` should have the output's shape {want}, but got shape {g.shape}")
    if lay is not None:
        g = lay.gather_out(g)                                # the layout's rows into the dense problem's
    dO, do_bad = prob.clean_grad_out(g, residuals.empty)    # 0 where never read, and where not finite
    dlse, dl_bad = None, None
    if grad_lse is not None:
        gl = V.as_float_array(grad_lse, names[1])
        want = prob.out_shape[:-1] if lay is None else lay.lse_shape
        if gl.shape != want:
            raise ValueError(f"`{names[1]}` should have the LSE's shape {want}, but got shape {gl.shape}")
        gl = gl if lay is None else lay.gather_lse(gl)
        dlse, dl_bad = prob.clean_grad_lse(gl, residuals.empty)
    return dO, do_bad, dlse, dl_bad


def user_grads(residuals, gr, bad):
    """An engine's :class:`~sdpa_ref.engines.contract.Grads` (or their tangents) in the user's shapes, layout and
    dtypes, NaN where ``bad`` (:func:`sdpa_ref.poison.backward_taint`) says they read poison."""
    prob, lay = residuals.problem, residuals.layout
    nan_rows = prob.nan_rows_without_keys()              # S = 0 under "nan": as on a fully masked row with keys,
    gr = gr._replace(dq=poison.nan_where(gr.dq, nan_rows))   # dq NaN there, and the sinks' gradient of its head
    shapes, dtypes = prob.shapes, dict(prob.dtypes)

    def own(x, name):                                    # in the problem's input shape, NaN where it reads poison
        if x is None:
            return None
        fold = extra_shape(prob) if name == "sinks" else shapes[name]   # sinks: a reshape of their own shape
        x = unbroadcast(x, fold)
        x = x if bad is None else poison.show(x, bad[name])
        if name == "sinks" and nan_rows is not None:
            heads = np.broadcast_to(nan_rows.any(axis=(-2, -1)), prob.full_scores[:-2])
            x = poison.show(x, unbroadcast(heads.astype(np.int64), fold) > 0)
        return x.reshape(shapes[name])

    g = {n: own(x, n) for n, x in (("query", gr.dq), ("key", gr.dk), ("value", gr.dv), ("attn_mask", gr.dmask),
                                    ("bias", gr.dbias), ("sinks", gr.dextra))}
    if residuals.absorbed is not None:                   # MLA's qv: the joined gradients split, dV both uses
        g["query"], g["qv"], g["key"], g["value"] = residuals.absorbed.split(g["query"], g["key"], g["value"])
        if gr.absorbed is not None:                      # the engine's own split, rounded once (reproducible):
            g.update({n: np.where(np.isnan(g[n]), g[n], x)   # its values, NaN where the split above reads poison
                      for n, x in zip(("query", "qv", "key", "value"), gr.absorbed)})
        dtypes.update(residuals.absorbed.dtypes)
    if lay is not None:                                  # the gather's VJP: back into the layout
        g.update({n: lay.scatter_input(g[n], n) for n in ("query", "key", "value", "qv") if g.get(n) is not None})
    g = {n: None if x is None else round_to(x, dtypes[n], copy=False) for n, x in g.items()}
    if gr.dmod is not None:                              # the score function's captured tensors: NaN when any
        hit = bad is not None and any(np.any(bad[n]) for n in ("query", "key") if bad.get(n) is not None)
        mod = tuple(np.full_like(x, np.nan) if hit else x for x in gr.dmod)      # score's gradient reads poison
        return ScoreModGrads(**dict(g, qv=g.get("qv"), score_mod=mod))
    return (AttentionGrads if residuals.absorbed is None else AbsorbedGrads)(**g)


def sdpa_jvp(primals, tangents, *, method=None, precision="fast", layout=None, **options):
    r"""Forward-mode derivative of attention: ``(out, out_tangent)``.

    Parameters
    ----------
    primals : tuple
        ``(query, key, value)``; every other input and option is a keyword,
        as in :func:`sdpa_forward` (``bias=`` included).
    tangents : tuple or mapping
        ``(dquery, dkey, dvalue)``, ``(dquery, dkey, dvalue, dbias)`` or
        ``(dquery, dkey, dvalue, dbias, dsinks)`` or
        ``(dquery, dkey, dvalue, dbias, dsinks, dqv)`` (MLA's ``qv``), each
        of its primal's shape (in the layout's, with ``layout=``) and an
        input dtype, any of them ``None`` for zero; or a mapping by the
        inputs' names, ``{"value": dvalue}``, every name not given a zero
        tangent (names: ``query``, ``key``, ``value``, ``bias``, ``sinks``,
        ``qv``, the keywords of :func:`sdpa_forward`). The two forms give the
        same bits.
    method : {"fast", "plain", "tiled", "split"}, optional
        The engine (default ``"fast"``, or ``"tiled"`` when ``block_size`` is
        given, ``"split"`` with ``num_splits`` or ``split_bounds``), each with
        its own forward mode on its forward's residuals (``"split"``'s is
        ``"tiled"``'s):
        ``"plain"``, the plain engine's :func:`sdpa_ref.attention.jvp`;
        ``"fast"``, the same formulas with its backward's in-place pivoted
        row pass on the tangent scores (:func:`sdpa_ref.engines.fast.jvp`);
        ``"tiled"``, block by block from the row max and sum, in the
        forward's bounded memory (:func:`sdpa_ref.engines.tiled.jvp`; no
        ``L x S`` array).
    precision : {"fast", "reproducible"}, optional
        As in :func:`sdpa_forward`; ``"reproducible"`` computes the tangent
        in double-double too, faithfully rounded and the same bits everywhere.
    **options
        The keyword arguments of :func:`sdpa_forward`.

    Returns
    -------
    out, out_tangent : ndarray, (..., Hq, L, Ev)

    Raises
    ------
    ValueError
        A name in ``tangents`` that is no input's (the message lists the
        names), a tangent not of its primal's shape, or one for an input not
        given.
    TypeError
        ``tangents`` neither a tuple of 3 to 6 nor a mapping, or a mapping
        inside the tuple (one form or the other).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dv = (rng.standard_normal((2, 3)) for _ in range(4))
    >>> a = sdpa_jvp((q, k, v), {"value": dv})[1]
    >>> b = sdpa_jvp((q, k, v), (None, None, dv))[1]
    >>> bool(np.array_equal(a, b))
    True

    Notes
    -----
    Differentiating the forward in the direction of the tangents,

    .. math::

        dT &= s\,(dQ\,K^T + Q\,dK^T) \odot (1 - \tanh^2(T_{raw}/c)) + dB, \\
        dP &= P \odot (dT - \mathrm{rowsum}(P \odot dT)), \\
        dO &= \frac{dP \odot Z}{1-p} V + P_{drop}\, dV,

    the softcap factor only with softcap; with sinks the row sum takes the
    sink's column too, :math:`- p_\sigma\, d\sigma` (``dsinks``). Masked entries have :math:`P = 0`,
    so their :math:`dP` is 0; under ``"uniform"`` a fully masked row's
    :math:`P` is constant and its :math:`dP` is 0.
    """
    if not isinstance(primals, (tuple, list)) or len(primals) != 3:
        raise TypeError(f"`primals` should be a tuple (query, key, value), but got {V.describe(primals)}")
    if not isinstance(tangents, Mapping) and (not isinstance(tangents, (tuple, list)) or
                                              len(tangents) not in (3, 4, 5, 6)):
        raise TypeError("`tangents` should be a tuple (dquery, dkey, dvalue[, dbias[, dsinks[, dqv]]]) or a "
                        f"mapping by input name, but got {V.describe(tangents)}")
    V.check_choice("fast" if method is None else method, "method", ("fast", "plain", "tiled", "split"))
    out, res = sdpa_forward(*primals, method=method, precision=precision, layout=layout,
                            **dict(options, save_probs=True))
    prob = res.problem
    (dq, dk, dv, db, ds), (bq, bk, bv, bb, bs), dv_full = input_tangents(res, tangents)
    with single_threaded_blas():
        dO = Engine(res.method, res.block_size).jvp(prob, res.forward, dq, dk, dv, db, dv_full=dv_full, dextra=ds)
        bad = poison.jvp_taint(prob, res.taint, (dq, dk, dv, db), (bq, bk, bv, bb), dv_full, ds, bs)
    dO = poison.nan_where(dO, bad)                       # what reads poison: NaN
    dO = poison.nan_where(dO, prob.nan_rows_without_keys() if any(t is not None for t in (dq, dk, dv, db, ds))
                          else None)
    dO = round_to(dO.reshape(prob.out_shape), prob.out_dtype, copy=False)
    return out, (dO if res.layout is None else res.layout.out(dO))


def input_tangents(res, tangents, name="tangents"):
    """The input tangents ``(dq, dk, dv, dbias, dsinks)`` of the residuals' problem, where each was not finite,
    and ``dv_full`` (:meth:`sdpa_ref.problem.Problem.clean_tangents`), from the user's ``tangents`` (3 to 6 of
    them by position, or a mapping by input name; None or a name not given is zero; ``name`` for the messages):
    checked against the primals' shapes, gathered from a layout, MLA's ``qv`` joined, and cleaned as the primals
    were."""
    prob, lay, ab = res.problem, res.layout, res.absorbed
    names = ("query", "key", "value", "bias", "sinks", "qv")
    if isinstance(tangents, Mapping):                    # by name: a name not given is a zero tangent
        unknown = sorted(set(tangents) - set(names), key=str)
        if unknown:
            hint = (" (positions are the tuple form: pass a tuple or names, not both)"
                    if any(isinstance(u, (int, np.integer)) for u in unknown) else "")
            raise ValueError(f"`{name}` should map input names ({', '.join(names)}) to tangents, but got "
                             f"{', '.join(map(repr, unknown))}{hint}")
        ts = [tangents.get(n) for n in names]
        label = [f"{name}[{n!r}]" for n in names]
    else:
        ts = list(tangents) + [None] * (6 - len(tangents))
        label = [f"{name}[{i}]" for i in range(6)]
        nested = [i for i, t in enumerate(ts) if isinstance(t, Mapping)]
        if nested:                                       # one form or the other, never a mapping inside a tuple
            raise TypeError(f"`{name}[{nested[0]}]` should be an array (the tangent of `{names[nested[0]]}`), "
                            "but got a mapping: pass the tangents as a tuple by position or as a mapping by "
                            "input name, not both")
    if ts[5] is not None and ab is None:
        raise ValueError(f"`{name}` should have no qv tangent when no `qv` is given, but got one")
    # the user's shapes: the layout's over the dense ones of qv's join, over the joined problem's (one name each)
    user = {**prob.shapes, **({} if ab is None else ab.shapes), **({} if lay is None else lay.shapes)}
    if ts[3] is not None and prob.bias is None:
        raise ValueError(f"`{name}` should have no bias tangent when no `bias` is given, but got one")
    if ts[4] is not None and prob.sink is None:
        raise ValueError(f"`{name}` should have no sinks tangent when no `sinks` are given, but got one")
    conv = []
    for i, (arg, t) in enumerate(zip(names, ts)):
        if t is not None:
            t = V.as_float_array(t, label[i])
            want = user[arg]
            if t.shape != want:
                raise ValueError(f"`{label[i]}` should have the shape of `{arg}` {want}, "
                                 f"but got shape {t.shape}")
            if lay is not None and arg in lay.shapes:
                t = lay.gather_input(t, arg)                 # a tangent is gathered as its primal is
        conv.append(t)
    dq, dk, dv, db, ds, dqv = conv
    if ab is not None:                                   # MLA's qv: the joined problem's tangents
        dq, dk, dv = ab.tangents(dq, dk, dv, dqv)
    dq, dk, dv = (t if t is None or t.ndim != 2 else t[None] for t in (dq, dk, dv))
    if dq is not None:
        dq = dq.reshape(dq.shape[:-3] + prob.q.shape[-4:])
    (dq, dk, dv, db), (bq, bk, bv, bb), dv_full = prob.clean_tangents(dq, dk, dv, db)   # as the primals are
    bs = None
    if ds is not None:                                   # (..., Hq, 1, 1); a head's rows read its sink
        ds, bs = clean(_cast_real(ds, prob).reshape(extra_shape(prob) + (1, 1)))
    return (dq, dk, dv, db, ds), (bq, bk, bv, bb, bs), dv_full


def _cast_real(t, prob):
    """A sinks tangent in the real compute dtype (the sinks' own)."""
    return round_to(t, prob.sink.dtype, copy=False)
