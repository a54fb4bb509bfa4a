"""``torch.nn.functional.scaled_dot_product_attention`` as an implementation under test.

What PyTorch expresses, and so what the adapter declares in ``supports``:
one ``attn_mask`` (bool or float: a case's ``bias`` is passed as the float
mask when there is no bool mask), ``is_causal`` (top-left), bottom-right
causal through ``torch.nn.attention.bias.causal_lower_right``, ``scale``,
``enable_gqa``, and ``fully_masked="zero"`` (PyTorch >= 2.5). It has no
softcap, windows, ALiBi, per-batch lengths or explicit dropout mask; a case
needing a combination PyTorch refuses (a mask together with ``is_causal``)
raises ``NotImplementedError``, which the harness reports as skipped. So does
a backend chosen with ``backend=`` that has no kernel for a case (PyTorch's
"No available kernel" or "No viable backend"): the skip's reason is PyTorch's
message with the warnings it gave on why each kernel was not used.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..options import OPTION_NAMES

__all__ = ["torch_sdpa", "forward", "backward", "SUPPORTS", "NO_KERNEL"]

#: The starts of PyTorch's messages when the enabled backends have no kernel for the inputs.
NO_KERNEL = ("No available kernel", "No viable backend")

#: What PyTorch's SDPA can be asked for, among sdpa_ref's options (a new option is not supported until listed).
SUPPORTS = frozenset(OPTION_NAMES) & {"attn_mask", "is_causal", "scale", "enable_gqa", "fully_masked", "bias",
                                      "causal_alignment"}


def torch_sdpa(device="cpu", backend=None):
    """Wrap PyTorch's SDPA and its autograd into ``(forward, backward, supports)``.

    Parameters
    ----------
    device : str
        A torch device, e.g. ``"cpu"`` or ``"cuda"``.
    backend : str or torch.nn.attention.SDPBackend, optional
        ``"math"``, ``"flash"``, ``"efficient"`` or ``"cudnn"``: run under
        ``torch.nn.attention.sdpa_kernel`` with only that backend enabled.
    """
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError("the torch adapter needs PyTorch: python -m pip install torch") from exc

    def ctx():
        if backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        return sdpa_kernel(names[backend] if isinstance(backend, str) else backend)

    def tensor(x, grad=False):
        x = np.ascontiguousarray(x)
        if x.dtype.name == "bfloat16":                 # ml_dtypes' bfloat16: torch takes its bits
            t = torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
        elif x.dtype.name.startswith("float8"):
            raise NotImplementedError(f"PyTorch's SDPA does not compute in {x.dtype.name}")
        else:
            t = torch.from_numpy(x)
        t = t.to(device)
        return t.requires_grad_(True) if grad else t

    def array(t):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def prepare(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, bias=None,
                causal_alignment="top_left", fully_masked=None, grad=False):
        if fully_masked not in (None, "zero"):
            raise NotImplementedError(f"PyTorch >= 2.5 gives zeros on fully masked rows, not {fully_masked!r}")
        q, k, v = tensor(query, grad), tensor(key, grad), tensor(value, grad)
        mask, b = None, None
        if attn_mask is not None and bias is not None:
            raise NotImplementedError("PyTorch takes one attn_mask: a bool mask and a bias together")
        if attn_mask is not None:
            mask = tensor(attn_mask)
        elif bias is not None:
            b = tensor(np.asarray(bias, dtype=query.dtype), grad)
            mask = b
        causal = bool(is_causal)
        if causal and causal_alignment == "bottom_right":
            if mask is not None:
                raise NotImplementedError("PyTorch's causal_lower_right cannot be combined with another mask")
            import warnings

            from torch.nn.attention.bias import causal_lower_right

            with warnings.catch_warnings():      # its L > S warning: the harness judges what happens
                warnings.simplefilter("ignore", UserWarning)
                mask = causal_lower_right(query.shape[-2], key.shape[-2])
            causal = False
        elif causal and mask is not None:
            raise NotImplementedError("PyTorch refuses attn_mask together with is_causal")
        elif causal_alignment == "bottom_right" and not causal:
            pass                                   # alignment matters only with causal
        kw = {"attn_mask": mask, "is_causal": causal, "scale": scale}
        if enable_gqa:
            kw["enable_gqa"] = True
        return q, k, v, b, kw

    def sdpa(q, k, v, kw):
        """PyTorch's SDPA under the chosen backend; its "no kernel" refusal is a skip with PyTorch's reasons."""
        import warnings

        with warnings.catch_warnings(record=True) as seen, ctx():
            warnings.simplefilter("always", UserWarning)
            try:
                out = F.scaled_dot_product_attention(q, k, v, **kw)
            except RuntimeError as exc:
                if not any(s in str(exc) for s in NO_KERNEL):
                    raise
                why = [str(w.message).split(" (Triggered internally")[0] for w in seen]
                why = [w for w in why if w and not w.endswith("because:")]    # the headers, without a reason
                raise NotImplementedError(f"PyTorch {torch.__version__} (backend={backend!r}, device={device!r}): "
                                          + " ".join([str(exc).strip()] + why)) from exc
        for w in seen:                   # a call that ran: its warnings go on to the caller as they were
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return out

    def forward(query, key, value, **opts):
        q, k, v, _, kw = prepare(query, key, value, **opts)
        with torch.no_grad():
            out = sdpa(q, k, v, kw)
        return array(out)

    def backward(grad_out, query, key, value, **opts):
        q, k, v, b, kw = prepare(query, key, value, grad=True, **opts)
        out = sdpa(q, k, v, kw)
        out.backward(tensor(grad_out))
        grads = [q.grad, k.grad, v.grad] + ([b.grad] if b is not None else [])
        return tuple(array(g) for g in grads)

    forward.supports = SUPPORTS
    backward.supports = SUPPORTS
    return forward, backward, SUPPORTS


from ._lazy import _Lazy  # noqa: E402

forward = _Lazy(torch_sdpa, "forward", SUPPORTS)
backward = _Lazy(torch_sdpa, "backward", SUPPORTS)
