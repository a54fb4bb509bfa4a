r"""Judge any attention implementation against the reference, fairly at every dtype.

:func:`check_implementation` runs an implementation over a case suite
(:mod:`sdpa_ref.cases`) at each test dtype and compares its output (and, with
a backward, its gradients) with the reference in float64.

The default rule is FlashAttention's relative form with a fair baseline.
Let ``ref64`` be the reference in float64 on the test-dtype inputs, and
``honest`` the largest error of the honest ensemble (:mod:`.ensemble`):
kernels computing in the test dtype the ways real kernels do (matmuls
accumulated in float32 and rounded, softmax statistics in float32, ``P``
rounded before ``P V``; the scale on the scores, on q or on both; dense,
plain or online softmax in blocks; an exp correctly rounded or off by 32
ulp), each in a fixed order without the BLAS, so the allowance is the same
bits on every machine. Then a quantity passes when

.. math::

    \max|impl - ref64| \le \max(k \cdot \max|honest - ref64| + atol_{dtype},\;
    ulp_{dt}(M) / 2 + ulp_{64}(M))

with ``k = 3`` (calibrated by ``benchmarks/calibrate_rule.py``; see
:class:`RelativeRule`) and ``atol_dtype = 2 max|fl(fl(ref64 + 0.3) - 0.3) -
ref64|``, the rounding of the output's magnitude in that dtype
(FlashAttention's own floor). An implementation is thus allowed what honest
same-precision kernels err by, no more, and no fixed tolerance has to be
guessed per dtype; and never less than the rounding of the dtype ``dt`` the
quantity is returned in (``M = max|ref64|``; :func:`.rules.returned_rounding`),
so the exact value rounded to that dtype always passes. In float64 the
ensemble computes in float64 and the allowance is a few float64 roundings;
:class:`FixedRule` or :class:`ULPRule` state a float64 tolerance directly.

The test dtypes are float64, float32, float16 and, with the ``lowp`` extra
(``ml_dtypes``), bfloat16, float8_e4m3fn and float8_e5m2. At fp8, as
FlashAttention 3 takes them, ``query``, ``key`` and ``value`` are quantized
per (batch, kv-head) and the implementation also receives ``q_descale``,
``k_descale`` and ``v_descale`` (float32, ``batch + (Hkv,)``): the problem's
values are the products. It returns bfloat16 there, and its gradients are
those of the descaled problem (there is no JVP check at fp8).

NaN must meet NaN: a NaN where the reference has a number (or the reverse)
fails with an infinite error.

A result of another dtype than the inputs' is a failure (a float32 result
for float16 inputs is not a float16 kernel), and so is a complex one.

An implementation that raises is a failed case (``SystemExit`` included;
only ``KeyboardInterrupt``, the user's own Ctrl-C, stops the run). With
``timeout=SECONDS`` a case (its forward and backward together) that runs
past the limit is a failed case too, and the run goes on.

**Isolation.** With ``isolate=True`` (the default of ``sdpa-ref conform``)
the implementation runs in a child process and the reference and the
verdict stay in this one (:mod:`.isolate`): a child that dies, exits
(``os._exit``), forks and exits, hangs, ignores ``SIGALRM``, catches the
timeout or never answers is a failed case, killed with its process group
at the deadline, and the next case gets a fresh child. Without isolation
(the default in Python, for pytest) the implementation shares the
harness's process, and the harness cannot defend itself against it: code
that calls ``os._exit`` ends the process, pytest included, with the status
it chooses; code that monkeypatches NumPy or the judge, or reads the
reference from the caller's frames, can make a wrong answer pass; code
that ignores ``SIGALRM`` or catches the timeout runs past it (a late
answer still fails), and native code is never interrupted. What the
in-process harness does hold: a case passes only on arrays the
implementation returned (copied as they come back), within the time limit
if one is given, in the process that called it (a forked copy that
returns is stopped at once); anything else is a failed case.
"""

from __future__ import annotations

import inspect
import os
import time
from typing import Callable, Iterable, List, Optional, Sequence, Union

import numpy as np

from .._validate import check_choice, check_tolerance
from ..lse import check_base, check_empty
from ..options import FUNCTION_OPTIONS, OPTION_NAMES, check_bool
from .storage import STORAGE_LAYOUTS
from ._limits import CaseTimeout, call_in_process
from .casefile import load_cases
from .cases import Case, get_suite
from .isolate import DEFAULT_TIME_LIMIT, Isolated, LoadError, Remote
from .judge import Implementation, judge_case, reference_quantities
from .lowp import as_test_dtype
from .report import ConformanceReport, ConformanceRow
from .rules import FixedRule, RelativeRule, ULPRule, as_rule

__all__ = ["RelativeRule", "FixedRule", "ULPRule", "ConformanceRow", "ConformanceReport", "CaseTimeout",
           "DEFAULT_TIME_LIMIT", "LAYOUTS", "LoadError", "assert_conforms", "check_implementation",
           "reference_quantities", "resolve_requires", "resolve_supports"]

#: ``layout=``: ``"bhld"`` hands the implementation ``(..., H, L, E)`` arrays (PyTorch); ``"blhd"`` hands it
#: ``(..., L, H, E)`` (FlashAttention, JAX, xformers) and reads its results the same way. Masks and biases keep
#: the ``(..., H, L, S)`` layout of :func:`sdpa_ref.sdpa_forward` either way. ``"gathered"``: a top-k sparse
#: kernel, ``(..., L, H, E)`` arrays and ``gather_kv_indices`` ``(..., L, K)`` (:meth:`.cases.Case.gathered`).
#: ``"bhsd"`` and ``"bshd"``, the entry points' names (:mod:`sdpa_ref.axes`), are ``"bhld"`` and ``"blhd"``.
LAYOUTS = ("bhld", "blhd", "bhsd", "bshd", "gathered") + STORAGE_LAYOUTS
_ALIASES = {"bhsd": "bhld", "bshd": "blhd"}


def resolve_requires(forward, requires=None) -> frozenset:
    """The options every case must use for the implementation to be called: ``requires`` if given, else
    ``forward.requires``, else none."""
    if requires is None:
        requires = getattr(forward, "requires", None)
    if requires is None:
        return frozenset()
    if isinstance(requires, str):
        requires = (requires,)
    try:
        requires = frozenset(requires)
    except TypeError:
        raise TypeError(f"`requires` should be a set of option names, but got {type(requires).__name__}") from None
    unknown = requires - set(OPTION_NAMES + FUNCTION_OPTIONS)
    if unknown:
        raise ValueError(f"`requires` should name options among {OPTION_NAMES + FUNCTION_OPTIONS}, but got unknown "
                         f"{sorted(unknown)}")
    return requires


def resolve_supports(forward, supports=None, backward=None) -> frozenset:
    """The options to pass: ``supports`` if given, else ``forward.supports``, else the option names among the
    keyword parameters of ``forward`` (and of ``backward``, when given), else -- a ``**kwargs`` -- every option."""
    if supports is None:
        supports = getattr(forward, "supports", None)
    if supports is None:
        found = [_from_signature(f) for f in (forward, backward) if f is not None]
        found = [f for f in found if f is not None]
        if not found:
            return frozenset(OPTION_NAMES + FUNCTION_OPTIONS)
        return frozenset.intersection(*found)
    if isinstance(supports, str):
        supports = (supports,)
    supports = frozenset(supports)
    unknown = supports - set(OPTION_NAMES + FUNCTION_OPTIONS)
    if unknown:
        raise ValueError(f"`supports` should name options among {OPTION_NAMES + FUNCTION_OPTIONS}, but got unknown "
                         f"{sorted(unknown)}")
    return supports


def _from_signature(fn):
    """The option names ``fn`` takes as keywords, or None when it takes ``**kwargs`` or has no signature."""
    if isinstance(fn, Remote):                             # as the child saw it
        return None if fn.params is None else frozenset(set(fn.params) & set(OPTION_NAMES + FUNCTION_OPTIONS))
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(names & set(OPTION_NAMES + FUNCTION_OPTIONS))


def _as_dtypes(dtypes):
    """A tuple of dtype names from a name, a dtype, a scalar type, or a sequence of them."""
    if isinstance(dtypes, (str, np.dtype, type)) or not isinstance(dtypes, Iterable):
        dtypes = (dtypes,)
    out = []
    for d in dtypes:
        out.append(as_test_dtype(d, "dtypes").name)
    if not out:
        raise ValueError("`dtypes` should name at least one dtype, but got none")
    return tuple(out)


def check_implementation(
    forward: Callable,
    *,
    backward: Optional[Callable] = None,
    jvp: Optional[Callable] = None,
    supports: Optional[Iterable[str]] = None,
    requires: Optional[Iterable[str]] = None,
    suite: str = "quick",
    dtypes="float32",
    rule=None,
    layout: str = "bhld",
    deterministic: bool = False,
    poison: bool = False,
    cases: Union[None, str, "os.PathLike[str]", Sequence[Case]] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
    timeout: Optional[float] = None,
    isolate: bool = False,
    lse=None,
    lse_empty="-inf",
    guards: bool = True,
) -> ConformanceReport:
    r"""Run ``forward`` (and ``backward``, ``jvp``) over a case suite and judge them.

    Parameters
    ----------
    forward : callable
        ``forward(query, key, value, **case_options) -> out`` on NumPy arrays
        of the test dtype, with the keyword names of :func:`sdpa_forward`
        (only those the case uses and the implementation supports).
        ``fully_masked`` is passed only on cases where some row has no
        allowed key, so an implementation with one native policy can refuse
        the others. Raising ``NotImplementedError`` marks the case as
        skipped. It must return the inputs' dtype (bfloat16 for fp8 inputs, which
        come with ``q_descale``, ``k_descale`` and ``v_descale`` keywords: see
        the module docstring).
    backward : callable, optional
        ``backward(grad_out, query, key, value, **case_options)`` returning
        ``(dq, dk, dv)``, then ``dbias`` for a case with a bias and
        ``dsinks`` (in the sinks' dtype: float32 below float64) for a case
        with ``sinks``.
    jvp : callable, optional
        ``jvp((query, key, value), (dquery, dkey, dvalue), **case_options)``
        returning the output's tangent, judged like a gradient.
    supports : iterable of str, optional
        Option names the implementation understands (see
        :data:`sdpa_ref.OPTION_NAMES`, and ``score_mod``, ``mask_mod`` for a
        Python case that carries them); by default ``forward.supports``, else
        the option names among the keyword parameters of ``forward`` (and
        ``backward``), else (a ``**kwargs``) every option. A case needing
        another option is skipped, never called.
    requires : iterable of str, optional
        Option names the implementation always applies, whether passed or
        not: a causal-only kernel declares ``requires={"is_causal"}``
        (by default ``forward.requires``, else none). Only the cases that use
        every one of them are judged; the others are skipped, never called. A
        required option is passed only if it is also supported (a kernel
        without an ``is_causal`` keyword still gets causal cases).
    suite : {"quick", "full"}
    dtypes : str, dtype or sequence of them
        Test dtypes, e.g. ``"float32"`` or ``("float32", "float16")``.
    rule : {"relative", "fixed", "ulp"} or a rule object, optional
        Default :class:`RelativeRule`; a name takes that rule's defaults.
    layout : {"bhld", "blhd", "bhsd", "bshd", "gathered", "thd", "paged", "thd_paged"}
        The arrays as the implementation takes them: ``(..., H, L, E)``,
        ``(..., L, H, E)``, packed variable-length sequences (``"thd"``,
        FlashAttention's varlen API: ``cu_seqlens_q``, ``cu_seqlens_k``,
        ``max_seqlen_q``, ``max_seqlen_k`` keywords) or a paged KV cache
        (``"paged"``: ``q (B, L, Hq, E)`` against ``(pages, 16, Hkv, E)``
        with ``cache_seqlens`` and ``block_table``); in the last two the
        case's lengths are the sequences' (see :mod:`.storage`). Or
        ``"gathered"``: a top-k sparse kernel (DeepSeek sparse attention,
        FlashMLA, FlashAttention 4's ``gather_kv_indices``), called with
        ``(..., L, H, E)`` arrays and ``gather_kv_indices=`` ``(..., L, K)``
        int32: each case with ``K = ceil(S / 2)`` indices per query row
        drawn from ``[-1, S)`` (``-1`` names no key, a repeat counts once),
        shared by the heads; keys no index names must never be read. A
        case with FlashMLA's ``topk_length`` (full suite) passes it as
        ``(..., L)`` int32 to a kernel that supports it; a case with
        top-k indices is skipped in every other layout.
    deterministic : bool
        Also run the forward (and the backward) a second time on the same
        inputs: other bits in any result fail the case (rows
        ``determinism`` and ``determinism-backward``).
    poison : bool
        Also run the forward with NaN written into the keys and values that
        no row attends to and into the padded query rows: the output must
        still conform.
    cases : path or sequence of Case, optional
        Overrides ``suite``: your own problems, as :class:`Case` objects or
        as a JSON or TOML case file (see :mod:`sdpa_ref.harness.casefile`).
    progress : callable, optional
        ``progress(i, n, case_name)`` before each case.
    timeout : float, optional
        Seconds a case may take (forward, backward and the extra checks
        together, per dtype); one that runs past it is a failed case, and the
        run goes on. Python code is interrupted when the limit passes (by
        ``SIGALRM`` in the main thread on POSIX, else by an exception raised
        asynchronously in the calling thread); native code that never
        returns to Python cannot be interrupted, but a call that comes back
        late still fails. Isolated, the child is killed at the limit
        instead, and without a ``timeout`` the limit is
        :data:`DEFAULT_TIME_LIMIT` (600 s).
    isolate : bool
        Run the implementation in a child process (see the module
        docstring; :mod:`sdpa_ref.harness.isolate`). ``forward``,
        ``backward`` and ``jvp`` are then ``"module:function"`` strings or
        picklable callables, that is functions defined at the top level of
        an importable module (not in ``__main__``, not lambdas or
        closures); the child imports them with this process's
        ``sys.path``, the current directory last. Raises :class:`LoadError`
        (an ``ImportError``) if the child cannot load them. Default False:
        in this process, which the implementation can subvert (see the
        module docstring).

    lse : {None, "e", 2}, optional
        The forward also returns the log-sum-exp, ``(out, lse)``, in base e
        (FlashAttention, cuDNN, FlexAttention) or 2 (FlashInfer), of shape
        ``(..., H, L)`` in either layout, in float32 for float32 and
        narrower inputs (float64 for float64): the quantity ``lse``,
        judged against the reference's LSE and the honest ensemble's own
        (their softmax statistics in the work dtype).
    lse_empty : {"-inf", "+inf"} or float
        What the LSE of a row with no allowed key holds: ``"-inf"`` (the
        empty sum; FlashAttention 3/4, FlexAttention), ``"+inf"``
        (FlashAttention 2) or a number; met exactly. See
        :func:`sdpa_ref.convert_lse`.
    guards : bool
        Also call the forward twice more and the backward once more on
        guarded copies of the inputs (:mod:`sdpa_ref.harness.guards`): each
        floating-point input inside a larger buffer whose guard regions,
        before and after it and between its rows, hold NaN (the NaN run),
        then a huge finite value (the huge run; the backward: NaN only). A
        result that moves from the implementation's own by more than the
        rule allows fails the case with a ``guard`` row saying it "reads
        outside its inputs", and guard regions written to fail it as "writes
        outside its inputs"; a run that sees nothing adds no row. A kernel
        that raises on the strided inputs gets a ``guard`` skip. Default
        True; ``False`` skips the three calls.

    Returns
    -------
    ConformanceReport
        ``.ok``, ``.verdict`` (``"conforms"``, ``"does not conform"``, or
        ``"nothing judged"`` when every case was skipped: never a pass),
        ``.failures``, ``.counts``, ``.judged``, ``.skipped`` (with the
        reasons), ``str()`` (the table), ``.to_json()``, ``.to_csv()``.
    """
    rule = as_rule(rule)
    check_choice(layout, "layout", LAYOUTS)
    layout = _ALIASES.get(layout, layout)
    dtypes = _as_dtypes(dtypes)
    isolate = check_bool(isolate, "isolate")
    for name, fn in (("forward", forward), ("backward", backward), ("jvp", jvp)):
        if fn is not None and not callable(fn) and not (isolate and isinstance(fn, str)):
            raise TypeError(f"`{name}` should be callable{' or a module:function string' if isolate else ''}, "
                            f"but got {type(fn).__name__}")
    if timeout is not None:
        check_tolerance(timeout, "timeout")
        if timeout == 0:
            raise ValueError("`timeout` should be a finite number of seconds > 0, or None, but got 0")
    deterministic, poison = check_bool(deterministic, "deterministic"), check_bool(poison, "poison")
    guards = check_bool(guards, "guards")
    if lse is not None:
        check_base(lse, "lse")
        check_empty(lse_empty, "lse_empty")                # here, before any child starts
    if supports is not None:                               # the caller's own lists: refused before any child starts
        resolve_supports(None, supports)
    if requires is not None:
        resolve_requires(None, requires)
    meta = {}
    if isinstance(cases, (str, os.PathLike)):
        meta["cases_file"] = os.path.basename(os.fspath(cases))
        cases = load_cases(cases)
    suite_name = suite if cases is None else "custom"
    cases = list(get_suite(suite) if cases is None else cases)
    if not all(isinstance(c, Case) for c in cases):
        bad = next(c for c in cases if not isinstance(c, Case))
        raise TypeError(f"`cases` should be a case file's path or a sequence of Case, but holds a "
                        f"{type(bad).__name__}")
    if not isolate:
        return _run(cases, dtypes, (forward, backward, jvp), (forward, backward), supports, requires, layout,
                    deterministic, poison, call_in_process, rule, suite_name, meta, progress, timeout,
                    (lse, lse_empty), guards)
    limit = DEFAULT_TIME_LIMIT if timeout is None else timeout
    with Isolated({"forward": forward, "backward": backward, "jvp": jvp}, limit) as child:
        remote = child.start()
        fns = tuple(remote.get(n) for n in ("forward", "backward", "jvp"))
        declared = tuple(f if callable(f) else remote.get(n)       # a callable's attributes as this process has them
                         for n, f in (("forward", forward), ("backward", backward)))
        return _run(cases, dtypes, fns, declared, supports, requires, layout, deterministic, poison, child.run,
                    rule, suite_name, dict(meta, isolated=True), progress, limit, (lse, lse_empty), guards)


def _run(cases, dtypes, fns, declared, supports, requires, layout, deterministic, poison, limit, rule, suite_name,
         meta, progress, timeout, lse=(None, "-inf"), guards=False):
    """The loop of :func:`check_implementation` over ``cases`` and ``dtypes``: ``fns`` are the functions to call,
    ``declared`` the forward and backward whose attributes and signatures say what they support."""
    sup = resolve_supports(declared[0], supports, declared[1])
    req = resolve_requires(declared[0], requires)
    impl = Implementation(*fns, layout=layout, deterministic=deterministic, poison=poison, implied=req - sup,
                          limit=limit, lse=lse[0], lse_empty=lse[1], guards=guards)
    sup = sup | req | (frozenset({"q_lengths", "kv_lengths"}) if layout in STORAGE_LAYOUTS else frozenset())
    if layout == "gathered":                               # every case with its top-k key indices
        cases = [c.gathered() for c in cases]
        sup = sup | {"gather_kv_indices"}                  # the layout's own: a case with them is skipped elsewhere
    rows: List[ConformanceRow] = []
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.name)
        missing, lacking = case.option_names - sup, req - case.option_names
        for dt in dtypes:
            if missing:
                rows.append(ConformanceRow(case.name, dt, "all", "skip", note=f"needs {', '.join(sorted(missing))}"))
                continue
            if lacking:
                rows.append(ConformanceRow(case.name, dt, "all", "skip",
                                           note=f"does not use {', '.join(sorted(lacking))} (required)"))
                continue
            rows.extend(judge_case(case, dt, impl, rule, sup, timeout))
    return ConformanceReport(rows=rows, rule=rule.describe(), suite=suite_name,
                             seconds=time.perf_counter() - t0,
                             meta=dict(meta, dtypes=list(dtypes), layout=layout, supports=sorted(sup),
                                       requires=sorted(req), isolated=meta.get("isolated", False),
                                       time_limit=timeout, guards=guards, lse=None if lse[0] is None else
                                       {"base": "e" if impl.lse == "e" else 2, "empty": lse[1]}))


def assert_conforms(forward: Callable, backward: Optional[Callable] = None, **kwargs) -> ConformanceReport:
    """:func:`check_implementation`, raising ``AssertionError`` with the report's table when it does not conform.

    For pytest::

        def test_my_kernel():
            sdpa_ref.assert_conforms(my_forward, my_backward, dtypes=("float32", "float16"))
    """
    rep = check_implementation(forward, backward=backward, **kwargs)
    if rep.verdict == "nothing judged":
        raise AssertionError("nothing was judged: every case was skipped (see the reasons below); declare the "
                             "options the implementation supports, or give it cases it can take\n" + str(rep))
    if not rep.ok:
        raise AssertionError("the implementation does not conform:\n" + str(rep))
    return rep
