r"""Every attention keyword in one frozen object, validated once.

:class:`AttentionOptions` is the single list of the options of attention.
The public entry points build one from the user's keywords at the boundary;
everything below them (the allowed set, the score transforms, the engines)
reads its fields. The harness (cases, conformance, vectors, self-check), the
command line and the adapters take their vocabulary from it too:

* :data:`OPTION_NAMES`: the keywords an implementation under test may be
  called with (every field that defines *what* is computed);
* :data:`ARRAY_OPTIONS`: those that are arrays (stored as such in golden
  vectors); the rest are scalars.

The options of the score chain's element-wise stages (``softcap``,
``score_mod``) are declared by the stages themselves
(:data:`sdpa_ref.transforms.SCORE_STAGES`: name, default, check and
documentation beside the stage's math): :class:`AttentionOptions` holds
their values in one field, ``stages``, and reads them as attributes
(``opts.softcap``), so a new stage adds its option without a line here.

The scalar fields are checked and normalised here (``window`` becomes a
pair of ``int`` or ``None``, ``-1`` meaning unbounded; the peers' other
spellings of it, deprecated here, translate in :mod:`sdpa_ref.flash`). Array fields are
checked against the shapes of ``query``, ``key`` and ``value`` when the
problem is built (:mod:`sdpa_ref.problem`), since only then are the shapes
known.
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Tuple

import numpy as np

from . import _validate as V
from .block_mask import BlockMask
from .masks import ALIGNMENTS
from .policy import DEFAULT as _DEFAULT_POLICY
from .policy import FULLY_MASKED_POLICIES
from .transforms import ALIBI_MODES, SCORE_STAGES, check_softcap

__all__ = [
    "ALIGNMENTS",
    "FUNCTION_OPTIONS",
    "DOC_OPTIONS",
    "ARRAY_OPTIONS",
    "FULLY_MASKED_POLICIES",
    "OPTION_NAMES",
    "AttentionOptions",
]


def _opt(default, *, array=False, semantic=True, judged=True):
    """A field: ``array`` options are arrays; ``semantic`` ones change what is computed; ``judged`` ones are
    in the harness's vocabulary (the cases, the judge's ensemble, the golden vectors and the C client)."""
    return field(default=default, metadata={"array": array, "semantic": semantic, "judged": judged})


@dataclass(frozen=True)
class AttentionOptions:
    """The options of attention, as in :func:`sdpa_ref.sdpa_forward`.

    Build it with :meth:`from_kwargs` (which validates); the constructor
    itself trusts its arguments. See ``SEMANTICS.md`` for what each one
    means. ``rng`` and ``upcast`` decide how, not what: they are not in
    :data:`OPTION_NAMES`.
    """

    attn_mask: Any = _opt(None, array=True)
    dropout_p: float = _opt(0.0)
    is_causal: bool = _opt(False)
    scale: Optional[float] = _opt(None)
    enable_gqa: bool = _opt(False)
    dropout_mask: Any = _opt(None, array=True)
    rng: Any = _opt(None, semantic=False)
    fully_masked: str = _opt(_DEFAULT_POLICY)
    upcast: bool = _opt(True, semantic=False)
    bias: Any = _opt(None, array=True)
    causal_alignment: str = _opt("top_left")
    window: Optional[Tuple[Optional[int], Optional[int]]] = _opt(None)
    # the score stages' options by name (softcap, score_mod, a registered stage's): opts.softcap reads them
    stages: dict = field(default_factory=dict, metadata={"array": False, "semantic": True, "judged": True})
    alibi_slopes: Any = _opt(None, array=True)
    q_lengths: Any = _opt(None, array=True)
    kv_lengths: Any = _opt(None, array=True)
    sinks: Any = _opt(None, array=True)
    # the allowed sets kernels define beyond the classic ones (the first three not in the harness's vocabulary:
    # gather_kv_indices comes with check_implementation's layout="gathered"; topk_length, q_offset are judged)
    sink_token_length: int = _opt(0, judged=False)
    attention_chunk: Optional[int] = _opt(None, judged=False)
    gather_kv_indices: Any = _opt(None, array=True, judged=False)
    topk_length: Any = _opt(None, array=True)   # FlashMLA: each row's count of gather_kv_indices (layout="gathered")
    q_offset: Any = _opt(None, array=True)      # per-sequence query position: off = q_offset[b]
    alibi_mode: str = _opt("flash")             # "flash" -m|i + off - j|, or cuDNN's m (j - i)
    qv: Any = _opt(None, array=True, judged=False)          # MLA's absorbed second query (sdpa_ref.absorbed)
    # programmable attention (sdpa_ref.score_mod): FlexAttention's mask function (its score function is a stage)
    mask_mod: Any = _opt(None, judged=False)
    block_mask: Any = _opt(None, judged=False)               # sdpa_ref.block_mask: tiles, with its mask function

    def __post_init__(self):
        # each score stage's option as a plain attribute, so that ``opts.softcap`` (read on every block of every
        # engine) is an ordinary lookup; ``__getattr__`` answers for a stage registered after this record was made
        for st in SCORE_STAGES:
            if st.option is not None:
                object.__setattr__(self, st.option, self.stages.get(st.option, st.default))

    def __getattr__(self, name):
        """A score stage's option (``opts.softcap``): its value in ``stages``, or the stage's default."""
        if not name.startswith("__") and name != "stages":
            given = self.__dict__.get("stages", {})
            if name in given:
                return given[name]
            for st in SCORE_STAGES:
                if st.option == name:
                    return st.default
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def has_slope(self) -> bool:
        """Whether the score chain has an element-wise part with a slope (softcap, a score function, any
        element-wise stage of :data:`~sdpa_ref.transforms.SCORE_STAGES`), which a backward or JVP reads
        (``Forward.slope``)."""
        return any(getattr(self, st.option) is not None for st in SCORE_STAGES if st.elementwise)

    @classmethod
    def from_kwargs(cls, where: str = "sdpa_forward", **kwargs) -> "AttentionOptions":
        """Validate the scalar options (each once; a score stage's by its own ``check``); an unknown keyword is a
        `TypeError` naming ``where``."""
        stages, names, known = _vocabulary()
        kwargs, spelled = _without_deprecated(kwargs)
        if not known.issuperset(kwargs):
            unknown = sorted(set(kwargs) - known)
            raise TypeError(f"`{where}` got unexpected keyword(s) {', '.join(unknown)}; the attention options "
                            f"are {', '.join(names)}")
        o = dict(_DEFAULTS, **(kwargs if stages.keys().isdisjoint(kwargs) else
                               {k: v for k, v in kwargs.items() if k not in stages}))
        for name in ("is_causal", "enable_gqa", "upcast"):
            o[name] = check_bool(o[name], name)
        V.check_choice(o["fully_masked"], "fully_masked", FULLY_MASKED_POLICIES)
        V.check_choice(o["causal_alignment"], "causal_alignment", ALIGNMENTS)
        V.check_choice(o["alibi_mode"], "alibi_mode", ALIBI_MODES)
        if o["q_offset"] is not None and o["causal_alignment"] != "top_left":
            raise ValueError(f"`q_offset` should not be given beside `causal_alignment={o['causal_alignment']!r}` "
                             "(the offset replaces the alignment: bottom-right is `q_offset = S - L`, or "
                             "`kv_len - q_len` per sequence), but got both")
        if o["topk_length"] is not None and o["gather_kv_indices"] is None:
            raise ValueError("`topk_length` should be given with `gather_kv_indices` (it counts each row's indices), "
                             "but got it alone")
        o["window"] = _check_reach(_check_window(o["window"], signed=True), o["is_causal"])
        o["window"] = _deprecated_windows(o["window"], spelled, o["is_causal"])
        o["sink_token_length"] = _count(o["sink_token_length"], "sink_token_length", 0)
        chunk = o["attention_chunk"]
        o["attention_chunk"] = None if chunk is None or (_count(chunk, "attention_chunk", 0) == 0) \
            else _count(chunk, "attention_chunk", 1)
        if o["scale"] is not None:
            o["scale"] = check_scale(o["scale"], "scale")
        o["stages"] = {n: _check_stage(st, kwargs.get(n, st.default)) for n, st in stages.items()}
        p = V.as_real_scalar(o["dropout_p"], "dropout_p")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"`dropout_p` should be in [0, 1), but got {p!r}")
        o["dropout_p"] = p
        if o["block_mask"] is not None:                      # its mask function is the problem's
            if not isinstance(o["block_mask"], BlockMask):
                raise TypeError(f"`block_mask` should be a sdpa_ref.BlockMask, but got {V.describe(o['block_mask'])}")
            if o["mask_mod"] is not None and o["mask_mod"] is not o["block_mask"].mask_mod:
                raise ValueError("`mask_mod` should not be given beside `block_mask` (its mask function goes inside "
                                 "it, as in FlexAttention), but got both")
            o["mask_mod"] = o["block_mask"].effective_mask_mod()
        if o["mask_mod"] is not None and not callable(o["mask_mod"]):
            raise TypeError(f"`mask_mod` should be a callable mask_mod(b, h, q_idx, kv_idx) -> bool, "
                            f"but got {V.describe(o['mask_mod'])}")
        return cls(**o)


def _names(keep, judged=False):
    """The names of the fields that ``keep(field)`` keeps, the ``stages`` field spelled out as the options of
    :data:`~sdpa_ref.transforms.SCORE_STAGES` in the table's order (only the judged ones with ``judged``)."""
    out = []
    for f in fields(AttentionOptions):
        if not keep(f):
            continue
        if f.name == "stages":
            clash = [st.option for st in SCORE_STAGES if st.option in _BASE]
            if clash:
                raise TypeError(f"a score stage's option should not be a field of AttentionOptions, but got "
                                f"{clash[0]!r}")
            out += [st.option for st in SCORE_STAGES if st.option is not None and (st.judged or not judged)]
        else:
            out.append(f.name)
    return tuple(out)


_VOCABULARY = {}


def _vocabulary():
    """``({option: stage}, every option name in order, the same as a set)`` for the score stages registered now
    (kept per state of the table, so a call does not rebuild them)."""
    key = tuple(map(id, SCORE_STAGES))
    got = _VOCABULARY.get(key)
    if got is None:
        names = _names(lambda f: True)
        got = _VOCABULARY[key] = ({st.option: st for st in SCORE_STAGES if st.option is not None}, names,
                                  frozenset(names))
    return got


def _check_stage(stage, value):
    """A stage's option checked by the stage (None: off, as given)."""
    return value if value is None or stage.check is None else stage.check(value, stage.option)


_BASE = frozenset(f.name for f in fields(AttentionOptions))
_DEFAULTS = {f.name: f.default for f in fields(AttentionOptions) if f.name != "stages"}
#: The keywords that define what attention computes and the harness judges (what an implementation under
#: test may be passed); the score stages' judged options sit where the ``stages`` field is.
OPTION_NAMES = _names(lambda f: f.metadata["semantic"] and f.metadata["judged"], judged=True)
#: The options of :data:`OPTION_NAMES` that are arrays.
ARRAY_OPTIONS = tuple(f.name for f in fields(AttentionOptions) if f.metadata["array"] and f.name in OPTION_NAMES)


#: The options that are functions (FlexAttention's score and mask functions): a Python :class:`~sdpa_ref.Case`
#: may carry them and the harness judges them, but no case file or golden vector can hold one.
FUNCTION_OPTIONS = ("score_mod", "mask_mod")


_DOC_HEAD = r"""
    query : array_like, (..., Hq, L, E)
    key : array_like, (..., Hkv, S, E)
    value : array_like, (..., Hkv, S, Ev)
        Floating arrays: float64, float32, float16, or bfloat16 (ml_dtypes;
        computed in float64, so not with ``upcast=False``). fp8 is refused:
        dequantize it first. Leading batch dims broadcast as in ``np.matmul``.
    attn_mask : array_like, optional, broadcastable to (..., Hq, L, S)
        Bool: True means the key takes part. Float: added to the scores
        (``-inf`` entries are excluded exactly).
    dropout_p : float, optional
        Dropout probability in ``[0, 1)``, applied to ``P`` after the softmax
        with the scale ``1 / (1 - p)``.
    is_causal : bool, optional
        Keep ``j <= i + off`` (see ``causal_alignment``). Combined with the
        other masks by intersection (PyTorch refuses mask + causal).
    scale : float, optional
        Score scale; ``1 / sqrt(E)`` by default (1 when ``E == 0``). Must be
        finite and non-zero.
    enable_gqa : bool, optional
        Grouped-query attention: ``Hkv`` divides ``Hq`` and query head ``h``
        reads kv head ``h // G``, ``G`` the group size (``repeat_interleave``
        semantics).
    **options
        The keyword-only options of :class:`~sdpa_ref.options.AttentionOptions`:

        dropout_mask : array_like of bool, broadcastable to (..., Hq, L, S)
            Explicit keep mask ``Z`` (True keeps), used whenever given.
        rng : numpy.random.Generator or int
            Source of the keep mask when ``dropout_p > 0`` and no
            ``dropout_mask`` is given. ``None`` draws fresh OS entropy.
        fully_masked : {"zero", "nan", "uniform", "jax"}
            What a row with no allowed key gets: zeros (PyTorch >= 2.5,
            FlashAttention), NaN (textbook, xformers), the mean of ``V``
            over all ``S`` keys, or JAX's: JAX masks with a finite sentinel,
            so such a row averages the keys the structural rules (bool mask,
            causal, window, lengths, ...) exclude from it, and is NaN when
            they exclude none (a float mask or bias of ``-inf`` on every
            key). ``"uniform"`` and ``"jax"`` differ only on rows emptied by
            ``-inf`` floats. Query rows past ``q_lengths`` are zeros under
            every policy.
        upcast : bool
            Compute in float64 and return the inputs' dtype (default), or
            compute in the inputs' own dtype to stand in for a low-precision
            kernel.
        bias : array_like, broadcastable to (..., Hq, L, S)
            Float additive bias, separate from ``attn_mask``; has its own
            gradient.
        causal_alignment : {"top_left", "bottom_right"}
            Offset of the diagonal for ``is_causal``, ``window`` and ALiBi:
            ``off = 0`` (PyTorch, JAX) or ``off = S - L`` (FlashAttention,
            xformers); with per-batch lengths ``kv_len - q_len``.
        window : (int or None, int or None)
            Sliding window ``(left, right)``, inclusive: keeps
            ``i + off - left <= j <= i + off + right``; ``None`` is unbounded
            on that side (``-1`` too, FlashAttention 2 and 3's spelling, which
            case files and golden vectors use). A bound below ``-1`` reaches
            past the diagonal on the other side (FlashAttention 4);
            ``left + right < 0`` keeps no key and is refused. ``(None, 0)`` is
            causal. The peers' other spellings translate into it in
            :mod:`sdpa_ref.flash`: ``window_from_window_size`` (FlashAttention
            2 and 3), ``window_from_fa4`` (FlashAttention 4's
            ``window_size_left``, ``window_size_right``) and
            ``window_from_count`` (gpt-oss's ``sliding_window``, cuDNN's
            count: ``left = n - 1``); those keywords here are deprecated.
        sink_token_length : int >= 0
            StreamingLLM's sink tokens: the first ``n`` keys are exempt from
            the window's left bound (only: causal, the right bound and the
            lengths still apply).
        attention_chunk : int >= 1
            Llama 4's chunked attention: with ``p = i + off``, a row keeps the
            keys ``p - p mod C <= j < p - p mod C + C`` (intersected with the
            other masks). 0 or None: off.
        gather_kv_indices : array_like of int, broadcastable to (..., Hq, L, K)
            Top-k sparse attention (DeepSeek, FlashMLA, FlashAttention 4): row
            ``i`` keeps only the keys its ``K`` indices name; ``-1`` and any
            index outside ``[0, S)`` name none, a repeated index counts once.
            FlashAttention 4's ``(b, t, K)`` is ``(b, 1, t, K)`` here.
        topk_length : array_like of int, broadcastable to (..., Hq, L)
            FlashMLA's sparse attention: row ``i`` reads only its first
            ``topk_length[..., i]`` indices of ``gather_kv_indices`` (in
            ``[0, K]``); the rest are never read. FlashMLA's prefill
            ``(s_q,)`` is ``(L,)`` here, its decode's ``(b,)`` ``(b, 1, 1)``.
        q_offset : array_like of int, (...)
            Per-sequence position of the first query on the keys' axis:
            row ``i`` of sequence ``b`` is at ``i + q_offset[b]``, the
            diagonal of ``is_causal``, the window, the chunks and ALiBi
            (``causal_alignment`` is then ``"top_left"``: ``"bottom_right"``
            is ``q_offset = S - L``). Any int, negative included.
        qv : array_like, (..., Hq, L, Ev)
            MLA's absorbed attention (FlashMLA, FlashAttention 3): the
            scores are ``scale * (Q K^T + qv V^T)``, the default scale
            ``1 / sqrt(E + Ev)``; its gradient is ``grads.qv``, and ``dV``
            collects both uses of ``V``."""
_DOC_TAIL = r"""
        mask_mod : callable
            FlexAttention's mask function ``mask_mod(b, h, q_idx, kv_idx) ->
            bool`` (True: the key takes part), intersected with the other
            masks.
        block_mask : BlockMask
            FlexAttention's block-sparse mask (or cuDNN's bit-packed tiles,
            :meth:`~sdpa_ref.BlockMask.from_bits`) with its mask function,
            checked against it when the problem is built; the tiled engine
            takes its tiles as blocks, skips the absent ones and does not
            evaluate the mask function on the full ones
            (``residuals.tile_counts``).
        alibi_slopes : array_like, (Hq,) or (..., Hq)
            Adds ``-slope * |i + off - j|`` to the scores, as FlashAttention.
        alibi_mode : {"flash", "cudnn"}
            ALiBi's convention: ``"flash"`` (default) the term above;
            ``"cudnn"`` cuDNN's signed ``slope * (j - i)`` (its
            ``alibi_mask``), with no diagonal offset. They agree on the keys
            ``j <= i`` (top-left causal).
        q_lengths, kv_lengths : array_like of int, (...)
            Per-batch valid lengths. Keys ``j >= kv_len`` are excluded; query
            rows ``i >= q_len`` are zeroed in the output and every gradient.
        sinks : array_like, (Hq,) or (..., Hq)
            Learnable attention sinks (gpt-oss, FlashAttention 4): one logit
            per query head added to every row's softmax normaliser, with no
            value; finite or ``-inf`` (no sink). The LSE includes it
            (``lse_as(sink=False)``: the keys' alone); a row with no allowed
            key gives ``O = 0``, ``lse = sink`` (the policy applies only
            where the sink is ``-inf``). Its gradient is ``grads.sinks``.
    method : {"fast", "plain", "tiled", "split"}, optional
        The engine: ``"fast"`` (default; dense, in place, threaded over
        heads), ``"plain"`` (the dense schedule as the derivation reads, :mod:`sdpa_ref.attention`),
        ``"tiled"`` (FlashAttention's online softmax in bounded memory) or
        ``"split"`` (split-KV: partials over splits of the keys merged by
        their LSEs, as decode kernels do; :mod:`sdpa_ref.engines.splitkv`).
        They agree to rounding.
    block_size : int or "auto", optional
        The tiled engine's block: ``block_size`` queries by ``block_size``
        keys, so that no ``L x S`` array is ever built; peak memory is
        ``O((L + S)(E + Ev) + block_size S)`` per head and thread (the
        backward keeps one block of rows against every key, so that it
        recomputes the scores once; the blocks of rows run side by side in
        the package's threads, with the same bits as one). ``"auto"`` (the
        default of ``method="tiled"``) picks a size from L, S and a 64 MiB
        budget. Giving it selects the tiled engine.
    num_splits : int >= 1, optional
        Split-KV (FlashAttention's ``num_splits``): each sequence's
        ``kv_len`` keys in ``num_splits`` contiguous splits of
        ``ceil(kv_len / num_splits)`` keys, the last ones shorter or empty.
        Giving it (or ``split_bounds``) selects ``method="split"``.
    split_bounds : array_like of int, (..., n + 1), optional
        Split-KV with the splits a kernel uses: split ``i`` of a sequence
        holds its keys ``b[i] <= j < b[i + 1]``; broadcast over the batch
        dims, ``0`` first, non-decreasing, the last at least the key count.
        :func:`sdpa_ref.split_kv_partials` returns each split's own result."""
#: The numpydoc "Parameters" entries of the options, shared by the entry points' docstrings (the score stages'
#: entries are theirs, in the table's order).
DOC_OPTIONS = _DOC_HEAD + "".join(st.doc for st in SCORE_STAGES) + _DOC_TAIL


# ---------------------------------------------------------------- helpers


def check_bool(x, name):
    """``x`` as a Python bool, or a `TypeError` naming ``name``."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"`{name}` should be a bool, but got {V.describe(x)}")
    return bool(x)


def check_scale(x, name):
    """The score scale: a finite, non-zero real number, or a `TypeError` / `ValueError` naming ``name``."""
    s = V.as_real_scalar(x, name)
    if not np.isfinite(s) or s == 0.0:
        raise ValueError(f"`{name}` should be finite and non-zero, but got {s!r}")
    return s


def _count(x, name, low):
    """An int ``>= low`` (and at most ``2**62``), or a `TypeError` / `ValueError` naming ``name``."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise TypeError(f"`{name}` should be an int >= {low}, but got {V.describe(x)}")
    if not low <= x <= 2**62:
        raise ValueError(f"`{name}` should be an int in [{low}, 2**62], but got {x}")
    return int(x)


#: The window's spellings of the peers that the core API accepted beside ``window`` and now deprecates: each one
#: names the keywords it takes and the function of :mod:`sdpa_ref.flash` that translates it into ``window=``.
_DEPRECATED_WINDOWS = {"window_size_left": "window_from_fa4", "window_size_right": "window_from_fa4",
                       "sliding_window": "window_from_count"}


def _without_deprecated(kwargs):
    """``kwargs`` less the deprecated spellings of the window, and those spellings (name: value) apart."""
    if _DEPRECATED_WINDOWS.keys().isdisjoint(kwargs):
        return kwargs, {}
    spelled = {n: kwargs[n] for n in _DEPRECATED_WINDOWS if n in kwargs}
    return {n: x for n, x in kwargs.items() if n not in spelled}, spelled


def _deprecated_windows(window, spelled, is_causal):
    """The window from ``window`` or one deprecated spelling of it (FlashAttention 4's ``window_size_left`` /
    ``window_size_right``, or the count ``sliding_window``), with a `DeprecationWarning` naming the ``window=`` it
    is whenever a deprecated keyword is given (None included: no window, as it always was); at most one of the
    spellings may hold a window."""
    if not spelled:
        return window
    given = {n: x for n, x in spelled.items() if x is not None}
    forms = [n for n, on in (("window", window is not None),
                             ("window_size_left/right", "window_size_left" in given or "window_size_right" in given),
                             ("sliding_window", "sliding_window" in given)) if on]
    if len(forms) > 1:
        raise ValueError(f"`window`, `window_size_left`/`window_size_right` and `sliding_window` should not be "
                         f"combined (they are three spellings of one window), but got {' and '.join(forms)}")
    if "sliding_window" in spelled:
        n = spelled["sliding_window"]
        out = window if n is None else count_window(n)
        here = "None: pass no window" if n is None else \
            f"here `window={out!r}`; `sdpa_ref.flash.window_from_count({n!r})` translates it"
        _warn(f"`sliding_window` is deprecated: pass `window=(n - 1, None)` (with `is_causal=True`, as gpt-oss: "
              f"`window=(n - 1, 0)`); {here}")
        window = out
    if "window_size_left" in spelled or "window_size_right" in spelled:
        left, right = spelled.get("window_size_left"), spelled.get("window_size_right")
        out = window if (left, right) == (None, None) else fa4_window(left, right, is_causal)
        here = "None: pass no window" if (left, right) == (None, None) else \
            f"here `window={out!r}`; `sdpa_ref.flash.window_from_fa4({left!r}, {right!r})` translates it" \
            if -1 not in out else "a bound of -1 (one key past the diagonal) has no spelling in `window=`, where -1 " \
            "is unbounded as in FlashAttention 2 and 3"
        _warn(f"`window_size_left` and `window_size_right` are deprecated: pass `window=(left, right)` (None "
              f"unbounded, a negative bound past the diagonal on the other side); {here}")
        window = out
    return window


def _warn(message):
    """A `DeprecationWarning` attributed to the first frame outside the package: the line that spelled the
    window, whichever entry point it called."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def fa4_window(left, right, is_causal=False):
    """FlashAttention 4's window bounds as ``(left, right)``: each any int (negative: past the diagonal on the
    other side) or None (unbounded); a window that keeps no key (``left + right < 0``, the right bound at most 0
    under ``is_causal``) is a `ValueError`, where FlashAttention 4 silently drops the window."""
    left, right = (None if b is None else _signed(b, n) for b, n in zip((left, right),
                                                                        ("window_size_left", "window_size_right")))
    empty, eff = _keeps_none(left, right, is_causal)
    if empty:
        raise ValueError(f"`window_size_left` + `window_size_right` should be >= 0 (with is_causal the right bound "
                         f"is at most 0), or no key would be kept, but got {left} + {eff}; FlashAttention 4 silently "
                         "drops such a window and keeps every key: to get its result, pass no window")
    return (left, right)


def count_window(n):
    """A window counted in keys up to the diagonal (gpt-oss's ``sliding_window``, cuDNN's left bound) as
    ``(n - 1, None)``: ``n`` an int >= 1."""
    return (_count(n, "sliding_window", 1) - 1, None)


def _signed(b, name):
    """A window bound of FlashAttention 4: any int (negative: past the diagonal on the other side)."""
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, (numbers.Integral, np.integer)):
        raise TypeError(f"`{name}` should be an int or None, but got {V.describe(b)}")
    if abs(b) > 2**62:
        raise ValueError(f"`{name}` should be in [-2**62, 2**62] (None for unbounded), but got {b}")
    return int(b)


def _check_window(window, name="window", signed=False):
    """``(left, right)`` of ints or None (``-1`` is None), or a `TypeError` / `ValueError` naming ``name``.

    Without ``signed`` a bound is an int >= 0 (FlashAttention 2 and 3's ``window_size``, and the vocabulary of case
    files, golden vectors and the C client). With ``signed`` (the core's ``window``) a bound below -1 reaches past
    the diagonal on the other side, as in FlashAttention 4 (:func:`_check_reach` then refuses a window that keeps
    no key)."""
    if window is None:
        return None
    kinds = "ints, -1 or None" if signed else "ints >= 0, -1 or None"
    if not isinstance(window, (tuple, list)) or len(window) != 2:     # a set has no order: refused
        raise TypeError(f"`{name}` should be a pair (left, right) of {kinds}, but got {window!r}")
    out = []
    for side, b in zip(("left", "right"), window):
        if b is None:
            out.append(None)
            continue
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (numbers.Integral, np.integer)):
            raise TypeError(f"`{name}` {side} bound should be an int{'' if signed else ' >= 0, -1'} or None, but got "
                            f"{b!r}")
        if b == -1:
            out.append(None)
        elif b < 0 and not signed:
            raise ValueError(f"`{name}` {side} bound should be >= 0 (or -1 / None for unbounded), but got {b}")
        elif abs(b) > 2**62:
            raise ValueError(f"`{name}` {side} bound should be at most 2**62 (use None for unbounded), but got {b}")
        else:
            out.append(int(b))
    return tuple(out)


def _check_reach(window, is_causal):
    """The core's ``window`` unless it keeps no key: ``left + right < 0``, the right bound at most 0 under
    ``is_causal`` (only a negative bound can do it)."""
    empty, eff = _keeps_none(*(window or (None, None)), is_causal)
    if empty:
        left = window[0]
        raise ValueError(f"`window` left + right should be >= 0 (with is_causal the right bound is at most 0), or "
                         f"no key would be kept, but got {left} + {eff}")
    return window


def _keeps_none(left, right, is_causal):
    """Whether the window ``(left, right)`` (signed bounds, None unbounded) keeps no key of any row, with the
    right bound it has beside ``is_causal`` (causal is the right bound 0): ``left + right < 0``."""
    eff = 0 if is_causal and (right is None or right > 0) else right
    return left is not None and eff is not None and left + eff < 0, eff


#: :func:`_check_window` for a wrapper that spells the window otherwise (FlashAttention's ``window_size``).
check_window = _check_window
