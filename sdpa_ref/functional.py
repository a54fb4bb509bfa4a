r"""The softmax family with its derivatives, as ``torch.nn.functional`` holds its functions.

Each forward with its VJP and JVP along any ``axis``, stable for huge
logits (the row maximum is subtracted; ``log_softmax`` is ``x - logsumexp(x)``).
Their home, with the derivations, is :mod:`sdpa_ref.softmax`; ``softmax``,
``log_softmax`` and ``logsumexp`` are also at the top level.

>>> import numpy as np
>>> from sdpa_ref import functional as F
>>> p = F.softmax(np.array([0.0, 0.0]))
>>> F.softmax_vjp(p, np.array([1.0, 0.0]))
array([ 0.25, -0.25])
"""

from .softmax import (
    log_softmax,
    log_softmax_vjp,
    logsumexp,
    softmax,
    softmax_jacobian,
    softmax_jvp,
    softmax_lse,
    softmax_vjp,
)

__all__ = [
    "softmax",
    "softmax_lse",
    "log_softmax",
    "logsumexp",
    "softmax_vjp",
    "log_softmax_vjp",
    "softmax_jvp",
    "softmax_jacobian",
]
