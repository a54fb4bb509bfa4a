"""tinygrad's ``Tensor.scaled_dot_product_attention`` as an implementation under test.

tinygrad takes the harness's ``(..., H, L, E)`` arrays as they are (its
matmul broadcasts the batch dims) and differentiates with
``Tensor.gradient``. What it expresses, and so ``supports``: one
``attn_mask`` (bool, or float: a ``bias``; a bool mask and a bias together go
as the float mask, the bias where allowed and ``-inf`` elsewhere, which is how
tinygrad reads a bool mask), ``is_causal`` (top-left: ``tril`` of the
scores), ``enable_gqa`` (``repeat_interleave`` of the kv heads) and
``fully_masked="nan"`` (softmax of a row of ``-inf``). It has no ``scale``
argument (always ``1/sqrt(E)``), no bottom-right alignment, softcap, windows,
lengths, ALiBi, sinks or explicit dropout mask. What tinygrad itself refuses
(``attn_mask`` with ``is_causal``, a dtype its device lacks, no usable device)
raises ``NotImplementedError`` with tinygrad's message (reported as skipped).
"""

from __future__ import annotations

import numpy as np

from ..options import OPTION_NAMES

__all__ = ["tinygrad_sdpa", "forward", "backward", "SUPPORTS"]

#: What tinygrad's SDPA can be asked for, among sdpa_ref's options.
SUPPORTS = frozenset(OPTION_NAMES) & {"attn_mask", "bias", "is_causal", "enable_gqa", "fully_masked",
                                      "causal_alignment"}


def tinygrad_sdpa(device=None):
    """Wrap ``Tensor.scaled_dot_product_attention`` and ``Tensor.gradient`` into ``(forward, backward, supports)``.

    Parameters
    ----------
    device : str, optional
        A tinygrad device, e.g. ``"CPU"`` (needs clang) or ``"PYTHON"`` (its
        emulator); by default tinygrad's own choice (``DEV``).
    """
    try:
        from tinygrad import Tensor
    except ImportError as exc:  # pragma: no cover - exercised only without tinygrad
        raise ImportError("the tinygrad adapter needs its extra: python -m pip install 'sdpa_ref[tinygrad]'") from exc

    def tensor(x):
        return Tensor(np.ascontiguousarray(x), device=device)

    def call(query, key, value, attn_mask=None, bias=None, is_causal=False, enable_gqa=False,
             causal_alignment="top_left", fully_masked=None):
        if is_causal and causal_alignment != "top_left" and query.shape[-2] != key.shape[-2]:
            raise NotImplementedError("tinygrad's is_causal is the scores' tril, top-left aligned, not "
                                      f"causal_alignment={causal_alignment!r}")
        if fully_masked not in (None, "nan"):
            raise NotImplementedError(f"tinygrad gives a row with no allowed key the softmax of -inf, NaN "
                                      f"(fully_masked='nan'), not fully_masked={fully_masked!r}")
        if query.dtype.name.startswith("float8"):
            raise NotImplementedError(f"tinygrad's SDPA computes in the inputs' dtype, not {query.dtype.name}")
        try:
            q, k, v = tensor(query), tensor(key), tensor(value)
            mask = None
            if bias is not None:
                b = np.asarray(bias, dtype=query.dtype)
                mask = tensor(b if attn_mask is None else np.where(attn_mask, b, -np.inf).astype(b.dtype))
            elif attn_mask is not None:
                mask = tensor(attn_mask)
            out = q.scaled_dot_product_attention(k, v, attn_mask=mask, is_causal=bool(is_causal),
                                                 enable_gqa=bool(enable_gqa))
        except RuntimeError as exc:      # tinygrad's own refusals: a mask with is_causal, no usable device
            raise NotImplementedError(f"tinygrad: {exc}") from exc
        return out, (q, k, v) + ((mask,) if bias is not None else ())

    def array(t, dtype):
        try:
            return t.numpy().astype(dtype, copy=False)
        except (RuntimeError, FileNotFoundError) as exc:   # no usable device, no compiler (clang), no such dtype
            raise NotImplementedError(f"tinygrad: {exc}") from exc

    def forward(query, key, value, **opts):
        out, _ = call(query, key, value, **opts)
        return array(out, query.dtype)

    def backward(grad_out, query, key, value, **opts):
        out, inputs = call(query, key, value, **opts)
        grads = out.gradient(*inputs, gradient=tensor(grad_out))
        res = [array(g, x.dtype) for g, x in zip(grads, (query, key, value))]
        if len(grads) > 3:               # the float mask's gradient is the bias's, summed to its shape
            from ..broadcast import unbroadcast

            db = array(grads[3], query.dtype)
            res.append(unbroadcast(np.where(opts.get("attn_mask", True), db, 0), np.shape(opts["bias"])))
        return tuple(res)

    forward.supports = SUPPORTS
    backward.supports = SUPPORTS
    return forward, backward, SUPPORTS


from ._lazy import _Lazy  # noqa: E402

forward = _Lazy(tinygrad_sdpa, "forward", SUPPORTS)
backward = _Lazy(tinygrad_sdpa, "backward", SUPPORTS)
