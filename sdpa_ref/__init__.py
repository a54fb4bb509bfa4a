r"""sdpa_ref: a pure-NumPy reference for softmax and scaled dot-product attention.

Every backward is derived by hand (see each docstring's Notes) and proven
against finite differences. What is computed is specified in the project's
contract, SEMANTICS.md; docs/architecture.md shows where each part lives.

Shape legend, used in every docstring
-------------------------------------
``...``
    Leading batch dims; they broadcast as in ``np.matmul``.
``Hq``, ``Hkv``
    Query heads and key/value heads (``Hq == Hkv`` unless grouped-query
    attention is enabled, then ``Hq % Hkv == 0``).
``L``
    Query positions (target length).
``S``
    Key/value positions (source length).
``E``
    Width of queries and keys.
``Ev``
    Width of values (and of the output); may differ from ``E``.
``G``
    Query heads per kv head, ``Hq // Hkv``: the group axis of grouped-query
    attention. Inside the package queries are ``(..., Hkv, G, L, E)``, the
    same memory as ``(..., Hq, L, E)`` since head ``h = kv * G + g``.
``P``
    Partial results over disjoint sets of keys, stacked on a leading axis
    for :func:`merge_attention`: ``out_parts`` is ``(P, ..., Hq, L, Ev)``.

``total_q``, ``total_k``
    Rows of packed variable-length sequences (:class:`Packed`, ``thd``).
``B``, ``Lq``
    Sequences and query tokens against a KV cache (:class:`KVCache`, ``bshd``,
    or packed ``thd`` with ``cu_seqlens_q``).

So ``query`` is ``(..., Hq, L, E)``, ``key`` is ``(..., Hkv, S, E)``,
``value`` is ``(..., Hkv, S, Ev)`` and the output is ``(..., Hq, L, Ev)``;
with ``layout="bshd"`` (:mod:`sdpa_ref.axes`) they are ``(..., L, H, E)``.

Where the rest lives
--------------------
The top level holds the verbs of the quick start and the records they
return. The rest is in namespaces named for their job:

:mod:`sdpa_ref.functional`
    The softmax family with its VJPs, JVPs and Jacobian.
:mod:`sdpa_ref.gradcheck`
    Checking anyone's VJP, JVP and HVP by finite differences.
:mod:`sdpa_ref.conformance`
    Judging another implementation: cases, rules, golden vectors.
:mod:`sdpa_ref.flash`, :mod:`sdpa_ref.flex`
    FlashAttention's and FlexAttention's entry points, with their
    argument names.
:mod:`sdpa_ref.masks`, :mod:`sdpa_ref.alibi`, :mod:`sdpa_ref.lse`, :mod:`sdpa_ref.merge`
    Masks, ALiBi, the LSE family and merging split-KV partial results.
:mod:`sdpa_ref.options`, :mod:`sdpa_ref.api`
    The options' names and accepted values, and the engines' names.

A few names of the namespaces are also read from the top level on first
use, so that code that calls them there keeps working
(``sdpa_ref.window_mask`` is ``sdpa_ref.masks.window_mask``); CHANGELOG.md
lists them.
"""

from importlib import import_module as _import_module

from . import alibi, flash, gradcheck, lse, masks, merge, options  # noqa: F401  (namespaces the API imports anyway)
from ._info import info
from ._version import __version__
from .api import AttentionResiduals, scaled_dot_product_attention, sdpa_forward, split_kv_partials
from .block_mask import BlockMask
from .derivatives import AttentionGrads, sdpa_backward, sdpa_jvp
from .gradcheck import check_vjp
from .layouts import KVCache, Packed
from .lse import convert_lse
from .masks import causal_mask
from .merge import merge_attention
from .options import AttentionOptions
from .score_mod import ScoreMod
from .second_order import sdpa_backward_jvp, sdpa_hvp
from .softmax import log_softmax, logsumexp, softmax

__all__ = [
    "__version__",
    "info",
    # the softmax family's forwards (their derivatives: sdpa_ref.functional)
    "softmax",
    "log_softmax",
    "logsumexp",
    # attention, its derivatives and the records they hand over
    "scaled_dot_product_attention",
    "sdpa_forward",
    "sdpa_backward",
    "sdpa_jvp",
    "sdpa_backward_jvp",
    "sdpa_hvp",
    "AttentionResiduals",
    "AttentionGrads",
    "AttentionOptions",
    "ScoreMod",
    "BlockMask",
    "causal_mask",
    # sequences as kernels store them, and split-KV partial results
    "Packed",
    "KVCache",
    "merge_attention",
    "split_kv_partials",
    "convert_lse",
    # checking derivatives, and judging another implementation (the harness loads on first use)
    "check_vjp",
    "check_implementation",
    "assert_conforms",
]

#: Names read from a namespace on first use: the harness's (so that ``import sdpa_ref`` stays light), and names
#: that live in the namespace of their job, reachable here for code that calls them by the short path (CHANGELOG.md).
_ELSEWHERE = {
    "check_implementation": "conformance",
    "assert_conforms": "conformance",
    "check_merge": "conformance",
    **dict.fromkeys(("softmax_lse", "softmax_vjp", "log_softmax_vjp", "softmax_jvp", "softmax_jacobian"),
                    "functional"),
    **dict.fromkeys(("assert_vjp", "check_jvp", "assert_jvp", "check_hvp", "assert_hvp", "numerical_jacobian",
                     "GradcheckReport"), "gradcheck"),
    "check_score_mod": "flex",
    "flash_attn_varlen_func": "flash",
    "flash_attn_with_kvcache": "flash",
    "window_mask": "masks",
    "padding_mask": "masks",
    "alibi_bias": "alibi",
    "alibi_slopes": "alibi",
    "combine_lse": "lse",
    "merge_attention_backward": "merge",
    "sdpa_forward_complex": "api",
    "METHODS": "api",
    "FULLY_MASKED_POLICIES": "options",
    "OPTION_NAMES": "options",
    "BACKWARD_METHODS": "derivatives",
    "AbsorbedGrads": "residuals",
    "ScoreModGrads": "residuals",
}


#: The namespaces named for their job, reachable as attributes (``sdpa_ref.functional.softmax_vjp``) without an
#: import of their own; each is imported on first use.
NAMESPACES = ("core", "functional", "gradcheck", "conformance", "testing", "flash", "flex", "masks", "alibi", "lse",
              "merge", "options", "diagnostics", "harness", "adapters")


def __getattr__(name):
    """``sdpa_ref.X`` and ``from sdpa_ref import X`` for a name of :data:`_ELSEWHERE`, read from its namespace
    (imported on first use); a namespace of :data:`NAMESPACES` is imported on first use."""
    if name in NAMESPACES:
        return _import_module(f"{__name__}.{name}")
    home = _ELSEWHERE.get(name)
    if home is None:
        raise AttributeError(f"module 'sdpa_ref' has no attribute {name!r}")
    return getattr(_import_module(f"{__name__}.{home}"), name)


def __dir__():
    return sorted(set(globals()) | set(_ELSEWHERE) | set(NAMESPACES))
