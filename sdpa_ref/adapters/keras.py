"""Keras 3's ``keras.ops.dot_product_attention`` as an implementation under test.

Keras runs on the backend ``KERAS_BACKEND`` names (read when ``keras`` is
first imported); the adapter differentiates with that backend's autodiff
(``jax.vjp`` on ``"jax"``, autograd on ``"torch"``; another backend's
backward is a skip). Keras takes ``(B, T, N, H)``: the adapter folds the
leading batch dims into ``B`` and moves the head axis. What it expresses, and
so ``supports``: a bool ``attn_mask`` and a float ``bias`` (together),
``is_causal`` (top-left), ``scale``, ``enable_gqa`` (implicit: ``N`` a
multiple of ``K``) and ``softcap`` (its ``attn_logits_soft_cap``, which Keras
runs on JAX on TPU only and refuses elsewhere: that refusal is the skip's
reason). A row with no allowed key gets what the backend gives:
``fully_masked="jax"`` on JAX (its finite sentinel), ``"zero"`` on torch.
It needs ``Ev == E`` and has no dropout mask, lengths, windows, ALiBi or sinks, and no bottom-right
alignment; such a case raises ``NotImplementedError`` (reported as skipped).
"""

from __future__ import annotations

import numpy as np

from ..options import OPTION_NAMES
from ._fold import Folded

__all__ = ["keras_dpa", "forward", "backward", "SUPPORTS", "FULLY_MASKED"]

#: What keras.ops.dot_product_attention can be asked for: sdpa_ref's options but these (an option added
#: later is claimed until listed here).
SUPPORTS = frozenset(OPTION_NAMES) & {"attn_mask", "bias", "causal_alignment", "enable_gqa", "fully_masked",
                                      "is_causal", "scale", "softcap"}
#: What a row with no allowed key gets on each backend the adapter differentiates through.
FULLY_MASKED = {"jax": ("jax", "uniform"), "torch": ("zero",)}


def keras_dpa():
    """Wrap ``keras.ops.dot_product_attention`` and its backend's autodiff into ``(forward, backward, supports)``.

    The backend is Keras's (``KERAS_BACKEND``). Keras computes float64
    inputs in float32 on every backend but TensorFlow
    (``keras.backend.result_type``): those cases are skipped with that reason.
    """
    try:
        import keras
    except ImportError as exc:  # pragma: no cover - exercised only without keras
        raise ImportError("the Keras adapter needs its extra and a backend: python -m pip install 'sdpa_ref[keras]' "
                          "and KERAS_BACKEND=jax (or torch)") from exc
    name = keras.backend.backend()

    def prepare(query, key, value, attn_mask=None, bias=None, is_causal=False, scale=None, enable_gqa=False,
                softcap=None, causal_alignment="top_left", fully_masked=None):
        f = Folded(query, key, value)
        if is_causal and causal_alignment != "top_left" and f.L != f.S:
            raise NotImplementedError(f"keras.ops.dot_product_attention aligns is_causal top-left, not "
                                      f"causal_alignment={causal_alignment!r}")
        if fully_masked is not None and fully_masked not in FULLY_MASKED.get(name, ()):
            raise NotImplementedError(f"Keras on {name} gives a row with no allowed key what fully_masked="
                                      f"{FULLY_MASKED.get(name, ('unknown',))[0]!r} does, not {fully_masked!r}")
        if query.dtype.name.startswith("float8"):
            raise NotImplementedError(f"keras.ops.dot_product_attention does not compute in {query.dtype.name}")
        if value.shape[-1] != query.shape[-1]:
            raise NotImplementedError(f"keras.ops.dot_product_attention takes a value of the key's shape (its "
                                      f"docstring), so Ev == E, but got Ev={value.shape[-1]}, E={query.shape[-1]}")
        work = keras.backend.result_type(query.dtype.name, key.dtype.name, value.dtype.name)
        if work != query.dtype.name:     # Keras's own promotion: float64 computes as float32 but on TensorFlow
            raise NotImplementedError(f"Keras {keras.__version__} on {name} computes {query.dtype.name} inputs in "
                                      f"{work} (keras.backend.result_type)")
        kw = {"is_causal": bool(is_causal), "scale": scale}
        if attn_mask is not None:
            kw["mask"] = f.scores(attn_mask)
        if softcap is not None:
            kw["attn_logits_soft_cap"] = float(softcap)
        b = None if bias is None else f.scores(bias, query.dtype)
        qkv = tuple(np.swapaxes(x, 1, 2) for x in (f.q, f.k, f.v))      # (B, H, T, E) -> (B, T, H, E)
        return f, qkv, b, kw

    def attend(q, k, v, b, kw):
        try:
            return keras.ops.dot_product_attention(q, k, v, bias=b, **kw)
        except ValueError as exc:        # Keras's own refusal of an option on this backend or platform
            if "only supported" in str(exc) or "not supported" in str(exc):
                raise NotImplementedError(f"Keras {keras.__version__} on {name}: {exc}") from exc
            raise

    def forward(query, key, value, **opts):
        f, (q, k, v), b, kw = prepare(query, key, value, **opts)
        out = keras.ops.convert_to_numpy(attend(q, k, v, b, kw))
        return f.unfold(np.swapaxes(out, 1, 2)).astype(query.dtype, copy=False)

    def backward(grad_out, query, key, value, **opts):
        f, qkv, b, kw = prepare(query, key, value, **opts)
        g = np.swapaxes(f.fold(np.asarray(grad_out)), 1, 2)
        primals = qkv + ((b,) if b is not None else ())
        if name == "jax":
            import jax
            _, pullback = jax.vjp(lambda *p: attend(*p[:3], p[3] if len(p) > 3 else None, kw),
                                  *map(jax.numpy.asarray, primals))
            grads = [np.asarray(x) for x in pullback(jax.numpy.asarray(g))]
        elif name == "torch":
            import torch
            ts = [torch.tensor(np.ascontiguousarray(x), requires_grad=True) for x in primals]
            attend(*ts[:3], ts[3] if len(ts) > 3 else None, kw).backward(torch.tensor(np.ascontiguousarray(g)))
            grads = [t.grad.numpy() for t in ts]
        else:
            raise NotImplementedError(f"the adapter differentiates through Keras's jax and torch backends, not {name}")
        res = [f.unfold(np.swapaxes(x, 1, 2), i) for i, x in enumerate(grads[:3])]
        if b is not None:
            res.append(f.unfold(grads[3], shape=np.shape(opts["bias"])))
        return tuple(res)

    forward.supports = SUPPORTS
    backward.supports = SUPPORTS
    return forward, backward, SUPPORTS


from ._lazy import _Lazy  # noqa: E402

forward = _Lazy(keras_dpa, "forward", SUPPORTS)
backward = _Lazy(keras_dpa, "backward", SUPPORTS)
