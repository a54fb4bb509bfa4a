"""The ONNX ``Attention`` operator (opset 23) as an implementation under test, forward only.

Run by ONNX's reference evaluator (``onnx.reference.ReferenceEvaluator``,
``onnx/reference/ops/op_attention.py``) or by ONNX Runtime's CPU kernel.
The operator takes ``(B, H, L, E)``; the adapter folds the leading batch
dims into ``B``. What it expresses, and so ``supports``: ``scale`` (a 32-bit
float attribute, applied as ``sqrt(scale)`` to Q and to K: a float64 case
whose scale float32 cannot hold is skipped), ``is_causal`` (top-left without a cache;
bottom-right is the cache's offset, so with ``S >= L`` the adapter passes the
first ``S - L`` keys and values as ``past_key`` / ``past_value``), one
``attn_mask`` (a bool mask and a ``bias`` together go as one float mask:
the bias where allowed, ``-inf`` elsewhere, which is how the operator reads
a bool mask), GQA (``enable_gqa``: each kv head serves ``Hq / Hkv``
consecutive query heads), ``Ev != E``, ``softcap`` (on the scaled scores,
before the mask) and ``fully_masked="zero"`` (the operator's ``Y = 0``). It has
no dropout, lengths, windows (opset 25), ALiBi or sinks. A case it cannot
take, and an error in which ONNX Runtime says it does not implement or
support something, raise ``NotImplementedError`` with the backend's message
(reported as skipped).
"""

from __future__ import annotations

import numpy as np

from ..options import OPTION_NAMES
from ._fold import Folded

__all__ = ["onnx_attention", "forward", "forward_onnxruntime", "SUPPORTS", "OPSET", "RUNTIMES"]

#: What ONNX Attention (opset 23) can be asked for: sdpa_ref's options but these (an option added later is claimed
#: until listed here).
SUPPORTS = frozenset(OPTION_NAMES) & {"attn_mask", "bias", "causal_alignment", "enable_gqa", "fully_masked",
                                      "is_causal", "scale", "softcap"}
#: The opset of the ``Attention`` node the adapter builds.
OPSET = 23
#: The runtimes ``onnx_attention`` can run the node on.
RUNTIMES = ("reference", "onnxruntime")


def onnx_attention(runtime="reference"):
    """Wrap ONNX's ``Attention`` operator into ``(forward, None, supports)``.

    Parameters
    ----------
    runtime : {"reference", "onnxruntime"}
        ONNX's reference evaluator, or an ONNX Runtime ``InferenceSession``
        on the CPU execution provider.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"`runtime` should be one of {RUNTIMES}, but got {runtime!r}")
    try:
        import onnx
        from onnx import helper
        if runtime == "onnxruntime":
            import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - exercised only without onnx
        raise ImportError("the ONNX adapter needs its extra: python -m pip install 'sdpa_ref[onnx]'") from exc

    def run(feeds, attrs, past):
        names = ["Q", "K", "V", "attn_mask" if "attn_mask" in feeds else ""] + (["past_key", "past_value"] * past)
        names = names[:3] if names[3:] == [""] else names
        io = {n: helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
              for n, a in feeds.items()}
        outs = ["Y"] + (["present_key", "present_value"] if past else [])    # ONNX Runtime asks for them
        t = io["Q"].type.tensor_type.elem_type
        graph = helper.make_graph([helper.make_node("Attention", names, outs, **attrs)], "attention",
                                  [io[n] for n in names if n], [helper.make_tensor_value_info(o, t, None)
                                                                for o in outs])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        if runtime == "reference":
            from onnx.reference import ReferenceEvaluator
            return ReferenceEvaluator(model).run(None, feeds)[0]
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        try:
            sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            return sess.run(["Y"], feeds)[0]
        except Exception as exc:       # its own words for a missing kernel or an unsupported input
            text = str(exc)
            if "NOT_IMPLEMENTED" in text or "not support" in text or "not implemented" in text.lower():
                raise NotImplementedError(f"ONNX Runtime {ort.__version__}: {text.strip()}") from exc
            raise

    def forward(query, key, value, attn_mask=None, bias=None, is_causal=False, scale=None, enable_gqa=False,
                softcap=None, causal_alignment="top_left", fully_masked=None):
        if fully_masked not in (None, "zero"):
            raise NotImplementedError(f"ONNX Attention gives a row with no allowed key Y = 0 (fully_masked='zero'), "
                                      f"not fully_masked={fully_masked!r}")
        if query.dtype.name.startswith("float8"):
            raise NotImplementedError(f"ONNX Attention's T1 is bfloat16, float16, float or double, not "
                                      f"{query.dtype.name}")
        f = Folded(query, key, value)
        feeds = {"Q": f.q, "K": f.k, "V": f.v}
        if bias is not None:
            b = np.asarray(bias, dtype=query.dtype)
            feeds["attn_mask"] = f.scores(b if attn_mask is None else np.where(attn_mask, b, -np.inf).astype(b.dtype))
        elif attn_mask is not None:
            feeds["attn_mask"] = f.scores(attn_mask)
        attrs = {"is_causal": int(bool(is_causal))}
        if scale is not None:
            if float(np.float32(scale)) != float(scale) and query.dtype == np.float64:
                raise NotImplementedError(f"ONNX Attention's scale is a float (32-bit) attribute: scale={scale!r} "
                                          f"would be {float(np.float32(scale))!r}")
            attrs["scale"] = float(scale)
        if softcap is not None:
            attrs["softcap"] = float(softcap)
        past = bool(is_causal) and causal_alignment == "bottom_right" and f.S != f.L
        if past:
            if f.S < f.L:
                raise NotImplementedError("ONNX Attention aligns is_causal top-left; bottom-right is the offset of its "
                                          "KV cache (past_key), which cannot be negative (S < L)")
            cut = f.S - f.L
            feeds.update(past_key=f.k[:, :, :cut], past_value=f.v[:, :, :cut], K=f.k[:, :, cut:], V=f.v[:, :, cut:])
            feeds = {n: np.ascontiguousarray(a) for n, a in feeds.items()}
        return f.unfold(run(feeds, attrs, past)).astype(query.dtype, copy=False)

    forward.supports = SUPPORTS
    return forward, None, SUPPORTS


def _reference():
    return onnx_attention("reference")


def _onnxruntime():
    return onnx_attention("onnxruntime")


from ._lazy import _Lazy  # noqa: E402

forward = _Lazy(_reference, "forward", SUPPORTS)
forward_onnxruntime = _Lazy(_onnxruntime, "forward", SUPPORTS)
