"""``jax.nn.dot_product_attention`` as an implementation under test.

JAX works in the layout ``(B, T, N, H)``; the adapter moves the head axis,
folds any leading batch dims into one (after broadcasting), and uses
``jax.vjp`` for the backward. What JAX expresses, and so ``supports``: a
bool ``attn_mask`` and a float ``bias`` (together), ``is_causal``
(top-left), ``scale``, ``enable_gqa`` (implicit in JAX), ``q_lengths`` /
``kv_lengths`` (its ``query_seq_lengths`` / ``key_value_seq_lengths``),
``window`` (its ``local_window_size``, top-left), and
``fully_masked="jax"`` -- JAX's finite sentinel (``"uniform"`` is the same
unless ``-inf`` floats empty a row).
It has no dropout, softcap or ALiBi, no bottom-right alignment (with
``L != S``), and needs ``Ev == E``; such cases raise ``NotImplementedError``
(reported as skipped) with a reason naming what the case asks for. A rank-2
``(L, E)`` input runs as one head.
Float64 runs need ``jax.config.update("jax_enable_x64", True)``, which the
adapter sets.
"""

from __future__ import annotations

import numpy as np

from ..options import OPTION_NAMES
from ..transforms import SCORE_STAGES
from ..transforms import unbroadcast as _unbroadcast

__all__ = ["jax_dpa", "forward", "backward", "SUPPORTS"]

#: What jax.nn.dot_product_attention can be asked for: the options of sdpa_ref but these, and no score stage's
#: (softcap; a stage added later is not claimed).
SUPPORTS = frozenset(OPTION_NAMES) - {"sinks", "alibi_slopes", "alibi_mode", "dropout_p", "dropout_mask", "q_offset",
                                      "topk_length"} - {st.option for st in SCORE_STAGES}


def jax_dpa(implementation=None):
    """Wrap ``jax.nn.dot_product_attention`` and ``jax.vjp`` into ``(forward, backward, supports)``.

    ``implementation`` is passed through (``None``, ``"xla"`` or ``"cudnn"``).
    """
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:  # pragma: no cover - exercised only without jax
        raise ImportError("the JAX adapter needs JAX: python -m pip install jax") from exc
    jax.config.update("jax_enable_x64", True)

    def prepare(query, key, value, attn_mask=None, bias=None, is_causal=False, scale=None, enable_gqa=False,
                q_lengths=None, kv_lengths=None, window=None, causal_alignment="top_left", fully_masked=None):
        # what the case asks that JAX cannot express, most specific first: the alignment and Ev before the
        # fully-masked policy, which a bottom-right causal case with L > S asks for only because of its alignment
        if causal_alignment != "top_left" and (is_causal or window is not None) \
                and (query.shape[-2] != key.shape[-2] or q_lengths is not None or kv_lengths is not None):
            raise NotImplementedError(f"jax.nn.dot_product_attention aligns is_causal and local_window_size "
                                      f"top-left, not causal_alignment={causal_alignment!r}")
        if value.shape[-1] != query.shape[-1]:
            raise NotImplementedError(f"jax.nn.dot_product_attention takes a value of the key's shape, so Ev == E, "
                                      f"but got Ev={value.shape[-1]}, E={query.shape[-1]}")
        if fully_masked not in (None, "uniform", "jax"):
            raise NotImplementedError(f"jax.nn.dot_product_attention masks with a finite sentinel, so a row with no "
                                      f"allowed key averages V (fully_masked='jax'), not fully_masked={fully_masked!r}")
        L, S = query.shape[-2], key.shape[-2]
        batch = np.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
        n = int(np.prod(batch)) if batch else 1

        def to_btnh(x):
            x = np.broadcast_to(x, batch + x.shape[-3:]).reshape((n,) + x.shape[-3:])
            return jnp.asarray(np.swapaxes(x, 1, 2))      # (B, H, T, E) -> (B, T, H, E)

        def full(m, dtype=None):
            m = np.broadcast_to(m, batch + (query.shape[-3], L, S)).reshape((n, query.shape[-3], L, S))
            return jnp.asarray(m if dtype is None else m.astype(dtype))

        kw = {"is_causal": bool(is_causal), "scale": scale}
        if attn_mask is not None:
            kw["mask"] = full(attn_mask)
        if q_lengths is not None:
            kw["query_seq_lengths"] = jnp.asarray(np.broadcast_to(q_lengths, batch).reshape(n).astype(np.int32))
        if kv_lengths is not None:
            kw["key_value_seq_lengths"] = jnp.asarray(np.broadcast_to(kv_lengths, batch).reshape(n).astype(np.int32))
        if window is not None:
            big = L + S
            kw["local_window_size"] = tuple(big if w is None or w == -1 else int(w) for w in window)
        if implementation is not None:
            kw["implementation"] = implementation
        b = None if bias is None else full(bias, query.dtype)
        shape_out = batch + (query.shape[-3], L, value.shape[-1])
        return to_btnh(query), to_btnh(key), to_btnh(value), b, kw, shape_out, batch, n

    def from_btnh(y, shape):
        return np.swapaxes(np.asarray(y), 1, 2).reshape(shape)

    def forward(query, key, value, **opts):
        if query.ndim == 2:              # (L, E): one head, which JAX's (T, N, H) needs
            return forward(query[None], key[None], value[None], **opts)[0]
        q, k, v, b, kw, shape_out, _, _ = prepare(query, key, value, **opts)
        out = jax.nn.dot_product_attention(q, k, v, bias=b, **kw)
        return from_btnh(out, shape_out)

    def backward(grad_out, query, key, value, **opts):
        if query.ndim == 2:
            grads = backward(grad_out[None], query[None], key[None], value[None], **opts)
            return tuple(g[0] for g in grads[:3]) + tuple(grads[3:])
        q, k, v, b, kw, shape_out, batch, n = prepare(query, key, value, **opts)
        primals = (q, k, v) if b is None else (q, k, v, b)

        def f(*p):
            return jax.nn.dot_product_attention(p[0], p[1], p[2], bias=p[3] if len(p) > 3 else None, **kw)

        _, pullback = jax.vjp(f, *primals)
        g = np.swapaxes(np.asarray(grad_out).reshape((n,) + shape_out[-3:]), 1, 2)
        grads = pullback(jnp.asarray(g))
        out = []
        for arr, like in zip(grads[:3], (query, key, value)):
            full = from_btnh(arr, batch + like.shape[-3:])
            out.append(_unbroadcast(full, like.shape))
        if b is not None:
            db = np.asarray(grads[3]).reshape(batch + (query.shape[-3],) + grads[3].shape[-2:])
            out.append(_unbroadcast(db, np.shape(opts["bias"])))
        return tuple(out)

    forward.supports = SUPPORTS
    backward.supports = SUPPORTS
    return forward, backward, SUPPORTS


from ._lazy import _Lazy  # noqa: E402

forward = _Lazy(jax_dpa, "forward", SUPPORTS)
backward = _Lazy(jax_dpa, "backward", SUPPORTS)
