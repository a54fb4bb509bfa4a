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
    Sequences and query tokens against a KV cache (:class:`KVCache`, ``bshd``).

So ``query`` is ``(..., Hq, L, E)``, ``key`` is ``(..., Hkv, S, E)``,
``value`` is ``(..., Hkv, S, Ev)`` and the output is ``(..., Hq, L, Ev)``.
"""

from .api import (
    FULLY_MASKED_POLICIES,
    METHODS,
    AttentionResiduals,
    scaled_dot_product_attention,
    sdpa_forward,
    sdpa_forward_complex,
    split_kv_partials,
)
from .derivatives import BACKWARD_METHODS, AbsorbedGrads, AttentionGrads, sdpa_backward, sdpa_jvp
from .second_order import sdpa_backward_jvp, sdpa_hvp
from .residuals import ScoreModGrads
from .score_mod import ScoreMod, check_score_mod
from .block_mask import BlockMask
from .gradcheck import (
    GradcheckReport,
    assert_hvp,
    assert_jvp,
    assert_vjp,
    check_hvp,
    check_jvp,
    check_vjp,
    numerical_jacobian,
)
from .flash import flash_attn_varlen_func, flash_attn_with_kvcache
from .layouts import KVCache, Packed
from .lse import combine_lse, convert_lse
from .masks import causal_mask, padding_mask, window_mask
from .merge import merge_attention, merge_attention_backward
from .options import OPTION_NAMES, AttentionOptions
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
from .alibi import alibi_bias, alibi_slopes
from ._info import info

from ._version import __version__

__all__ = [
    "__version__",
    "info",
    # softmax family
    "softmax",
    "softmax_lse",
    "log_softmax",
    "logsumexp",
    "softmax_vjp",
    "log_softmax_vjp",
    "softmax_jvp",
    "softmax_jacobian",
    # attention
    "scaled_dot_product_attention",
    "sdpa_forward",
    "sdpa_backward",
    "sdpa_jvp",
    "sdpa_backward_jvp",
    "sdpa_hvp",
    "sdpa_forward_complex",
    "AbsorbedGrads",
    "ScoreMod",
    "BlockMask",
    "ScoreModGrads",
    "check_score_mod",
    "AttentionGrads",
    "AttentionResiduals",
    "FULLY_MASKED_POLICIES",
    "METHODS",
    "BACKWARD_METHODS",
    "AttentionOptions",
    "OPTION_NAMES",
    # sequences as kernels store them
    "Packed",
    "KVCache",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    # the LSE family and merging split-KV partial results
    "convert_lse",
    "combine_lse",
    "merge_attention",
    "merge_attention_backward",
    "split_kv_partials",
    # masks
    "causal_mask",
    "window_mask",
    "padding_mask",
    "alibi_bias",
    "alibi_slopes",
    # gradient checking
    "check_vjp",
    "assert_vjp",
    "check_jvp",
    "assert_jvp",
    "check_hvp",
    "assert_hvp",
    "numerical_jacobian",
    "GradcheckReport",
    # judging another implementation (sdpa_ref.harness, imported on first use)
    "check_implementation",
    "assert_conforms",
    "check_merge",
]

_HARNESS = ("check_implementation", "assert_conforms")


def __getattr__(name):
    """``sdpa_ref.check_implementation``, ``sdpa_ref.assert_conforms`` and ``sdpa_ref.check_merge`` load the
    harness on first use, so that ``import sdpa_ref`` stays light."""
    if name in _HARNESS:
        from .harness import conformance

        return getattr(conformance, name)
    if name == "check_merge":
        from .harness.merge_check import check_merge

        return check_merge
    raise AttributeError(f"module 'sdpa_ref' has no attribute {name!r}")
