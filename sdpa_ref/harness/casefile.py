r"""Your own problems in one file: case definitions in JSON or TOML.

A case file lists attention problems by their shapes, options, seed and
logit scale; :func:`load_cases` turns it into :class:`~.cases.Case`
objects, which every tool takes: ``check_implementation(cases=FILE)``,
``sdpa-ref conform --cases FILE``, ``sdpa-ref vectors --cases FILE`` (and so
the C client), and ``sdpa-ref verify``, which regenerates a set from the
definitions stored in its manifest. The inputs are drawn from the seed in
float64 and cast, exactly as for the built-in suites.

JSON::

    {"cases": [
      {"name": "causal-128", "L": 128, "E": 64, "Hq": 8, "batch": [2], "options": {"is_causal": true}},
      {"name": "gqa-window", "L": 64, "S": 96, "Hq": 8, "Hkv": 2, "seed": 3,
       "options": {"window": [16, 0], "causal_alignment": "bottom_right"}, "arrays": ["lengths"]}
    ]}

TOML (Python 3.11 or newer, or the ``tomli`` package)::

    [[cases]]
    name = "causal-128"
    L = 128
    E = 64
    Hq = 8
    options = { is_causal = true }

The fields of a case, with their defaults:

``name``
    Required; letters, digits, ``.``, ``_`` and ``-``, at most 100, unique
    in the file (it names the case's vector file).
``L``, ``S``
    Query and key positions, ``S`` defaults to ``L``.
``E``, ``Ev``
    Widths of query/key and of value: 64 and ``E``.
``Hq``, ``Hkv``
    Query and key/value heads: 1 and ``Hq``; ``Hq % Hkv == 0``, and
    ``Hq != Hkv`` implies ``enable_gqa``.
``batch`` (or ``batch_q`` and ``batch_kv``)
    The leading dims, ``[1]``; ``[]`` for none; ``batch_q`` and ``batch_kv``
    broadcast against each other, like ``np.matmul``.
``seed``, ``logit_scale``
    0 and 1.0: the queries are drawn times ``logit_scale``.
``options``
    Scalar attention options (``is_causal``, ``causal_alignment``,
    ``window``, ``softcap``, ``scale``, ``fully_masked``, ``dropout_p``),
    validated as :func:`sdpa_ref.sdpa_forward` validates them.
``arrays``
    Arrays to draw, among :data:`~.cases.ARRAY_KINDS`: ``mask``,
    ``masked_rows``, ``float_mask``, ``bias``, ``alibi``, ``lengths``,
    ``zero_kv``, ``dropout`` (``dropout`` needs ``dropout_p`` and is the
    only way to ask for dropout: a kernel is judged on an explicit keep mask),
    ``sinks`` (one logit per query head, float32 below float64; the last
    head has none when there are several), ``gather`` (top-k indices, judged
    with ``layout="gathered"``), ``topk`` (FlashMLA's ``topk_length``, with
    ``gather``), ``q_offset`` (one query offset per sequence, with the
    default ``causal_alignment``).

A file holds at most :data:`MAX_CASES` cases, each at most
:data:`MAX_SCORES` score entries (batch x Hq x L x S) and
:data:`MAX_INPUT` entries per input, so that a file (or a manifest) cannot
ask for more memory than a judge should give it. Every mistake is a
:class:`CaseFileError` (a ``ValueError``) naming the file, the case and the
field.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import List

import numpy as np

from ..options import ARRAY_OPTIONS, OPTION_NAMES, AttentionOptions
from ._files import read_regular_file
from .cases import ARRAY_KINDS, Case

__all__ = ["CASE_FIELDS", "CaseFileError", "MAX_CASES", "MAX_INPUT", "MAX_SCORES", "case_definition",
           "cases_from_definitions", "load_cases"]

#: The fields a case definition may have.
CASE_FIELDS = ("name", "L", "S", "E", "Ev", "Hq", "Hkv", "batch", "batch_q", "batch_kv", "seed", "logit_scale",
               "options", "arrays")
#: At most this many cases in one file.
MAX_CASES = 10_000
#: At most this many entries in a case's score array, batch x Hq x L x S.
MAX_SCORES = 1 << 26
#: At most this many entries in any one input (query, key or value).
MAX_INPUT = 1 << 26
#: The largest case file read.
MAX_FILE_BYTES = 16 << 20
#: Scalar options a file may set (``enable_gqa`` follows from the heads).
SCALAR_OPTIONS = tuple(n for n in OPTION_NAMES if n not in ARRAY_OPTIONS and n != "enable_gqa")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")


class CaseFileError(ValueError):
    """A case file (or a manifest's case definitions) that cannot be used; the message names where and why."""


def load_cases(path) -> List[Case]:
    """The cases defined in the JSON or TOML file ``path`` (TOML when it ends in ``.toml``).

    Parameters
    ----------
    path : str or os.PathLike
        A regular file of at most 16 MiB: ``{"cases": [definition, ...]}``
        (see the module docstring for the fields).

    Returns
    -------
    list of Case

    Raises
    ------
    CaseFileError
        With the file, the case and the field in its message.
    """
    where = os.fspath(path)
    data, why = read_regular_file(where, MAX_FILE_BYTES)
    if data is None:
        raise CaseFileError(f"cannot read the case file {where!r}: {why}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CaseFileError(f"the case file {where!r} should be UTF-8 text") from None
    if where.lower().endswith(".toml"):
        try:
            import tomllib as toml
        except ImportError:                                           # Python 3.10
            try:
                import tomli as toml
            except ImportError:
                raise CaseFileError(f"reading the TOML case file {where!r} needs Python 3.11 or the tomli "
                                    "package (python -m pip install tomli); or write it as JSON") from None
        try:
            doc = toml.loads(text)
        except toml.TOMLDecodeError as exc:
            raise CaseFileError(f"the case file {where!r} is not valid TOML: {exc}") from None
    else:
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise CaseFileError(f"the case file {where!r} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) - {"cases", "format", "version"}:
        raise CaseFileError(f"the case file {where!r} should hold an object with a 'cases' list (and optionally "
                            f"'format' and 'version'), but got "
                            f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
    return cases_from_definitions(doc.get("cases"), where=f"the case file {where!r}")


def cases_from_definitions(defs, where: str = "`cases`") -> List[Case]:
    """:class:`Case` objects from a list of definition dicts (as in a case file), each validated."""
    if not isinstance(defs, list) or not defs:
        raise CaseFileError(f"{where}: 'cases' should be a non-empty list of case definitions, but got "
                            f"{_show(defs)}")
    if len(defs) > MAX_CASES:
        raise CaseFileError(f"{where}: at most {MAX_CASES} cases, but got {len(defs)}")
    out, seen = [], set()
    for i, d in enumerate(defs):
        case = _one(d, f"{where}, case {i}")
        if case.name in seen:
            raise CaseFileError(f"{where}, case {i}: the name {case.name!r} is used twice")
        seen.add(case.name)
        out.append(case)
    return out


def case_definition(case: Case) -> dict:
    """The JSON-ready definition of ``case``: :func:`cases_from_definitions` gives the same case back."""
    opts = {k: (list(v) if isinstance(v, tuple) else v) for k, v in case.options}
    return {"name": case.name, "L": case.L, "S": case.S, "E": case.E, "Ev": case.Ev, "Hq": case.Hq,
            "Hkv": case.Hkv, "batch_q": list(case.batch_q), "batch_kv": list(case.batch_kv), "seed": case.seed,
            "logit_scale": case.logit_scale, "options": opts, "arrays": list(case.arrays)}


# ------------------------------------------------------------------ helpers


def _one(d, where) -> Case:
    if not isinstance(d, dict):
        raise CaseFileError(f"{where}: a case should be an object, but got {_show(d)}")
    unknown = sorted(set(d) - set(CASE_FIELDS))
    if unknown:
        raise CaseFileError(f"{where}: unknown field(s) {unknown}; a case has {', '.join(CASE_FIELDS)}")
    name = d.get("name")
    if not (isinstance(name, str) and _NAME.match(name)):
        raise CaseFileError(f"{where}: 'name' should be 1 to 100 letters, digits, '.', '_' or '-' (starting with a "
                            f"letter or digit), but got {_show(name)}")
    where = f"{where} ({name!r})"
    L = _int(d, "L", None, where, 1)
    S = _int(d, "S", L, where, 1)
    E = _int(d, "E", 64, where, 1)
    Ev = _int(d, "Ev", E, where, 1)
    Hq = _int(d, "Hq", 1, where, 1)
    Hkv = _int(d, "Hkv", Hq, where, 1)
    if Hq % Hkv:
        raise CaseFileError(f"{where}: 'Hq' should be a multiple of 'Hkv', but got Hq={Hq}, Hkv={Hkv}")
    if "batch" in d and ("batch_q" in d or "batch_kv" in d):
        raise CaseFileError(f"{where}: give 'batch', or 'batch_q' and 'batch_kv', not both")
    bq = _dims(d, "batch_q" if "batch_q" in d else "batch", where)
    bkv = _dims(d, "batch_kv" if "batch_kv" in d else ("batch_q" if "batch_q" in d else "batch"), where)
    try:
        batch = np.broadcast_shapes(bq, bkv)
    except ValueError:
        raise CaseFileError(f"{where}: 'batch_q' {list(bq)} and 'batch_kv' {list(bkv)} should broadcast against "
                            "each other") from None
    n_batch = math.prod(batch)
    sizes = {"scores (batch x Hq x L x S)": n_batch * Hq * L * S, "query": math.prod(bq) * Hq * L * E,
             "key": math.prod(bkv) * Hkv * S * E, "value": math.prod(bkv) * Hkv * S * Ev}
    for what, n in sizes.items():
        cap = MAX_SCORES if what.startswith("scores") else MAX_INPUT
        if n > cap:
            raise CaseFileError(f"{where}: the {what} would have {n} entries, more than the {cap} a case may have")
    seed = _int(d, "seed", 0, where, 0)
    if seed >= 1 << 63:
        raise CaseFileError(f"{where}: 'seed' should be below 2**63, but got {seed}")
    ls = d.get("logit_scale", 1.0)
    if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not (math.isfinite(ls) and ls > 0):
        raise CaseFileError(f"{where}: 'logit_scale' should be a finite number > 0, but got {_show(ls)}")
    opts = d.get("options", {})
    if not isinstance(opts, dict):
        raise CaseFileError(f"{where}: 'options' should be an object of option: value, but got {_show(opts)}")
    bad = sorted(set(opts) - set(SCALAR_OPTIONS))
    if bad:
        hint = " (array options are drawn: name them in 'arrays')" if set(bad) & set(ARRAY_OPTIONS) else ""
        hint += " ('enable_gqa' follows from Hq != Hkv)" if "enable_gqa" in bad else ""
        raise CaseFileError(f"{where}: unknown option(s) {bad}{hint}; a case file may set {', '.join(SCALAR_OPTIONS)}")
    opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in opts.items()}
    try:
        AttentionOptions.from_kwargs("case file", **opts)
    except (TypeError, ValueError) as exc:
        raise CaseFileError(f"{where}: {exc}") from None
    arrays = d.get("arrays", [])
    if not (isinstance(arrays, list) and all(isinstance(a, str) for a in arrays)) or len(set(arrays)) < len(arrays):
        raise CaseFileError(f"{where}: 'arrays' should be a list of distinct names among {', '.join(ARRAY_KINDS)}, "
                            f"but got {_show(arrays)}")
    bad = sorted(set(arrays) - set(ARRAY_KINDS))
    if bad:
        raise CaseFileError(f"{where}: unknown array(s) {bad}; 'arrays' may name {', '.join(ARRAY_KINDS)}")
    p = float(opts.get("dropout_p", 0.0))
    if (p > 0) != ("dropout" in arrays):
        raise CaseFileError(f"{where}: dropout is judged on an explicit keep mask: give both 'dropout_p' > 0 in "
                            "'options' and \"dropout\" in 'arrays', or neither")
    # the suite's order of arrays, so that the same definition gives the same case however it is written
    arrays = tuple(a for a in ARRAY_KINDS if a in arrays)
    try:                                         # what the arrays need beside each other (topk with gather, ...)
        return Case(name=name, L=L, S=S, E=E, Ev=Ev, Hq=Hq, Hkv=Hkv, batch_q=bq, batch_kv=bkv, seed=seed,
                    options=tuple(sorted(opts.items())), arrays=arrays, logit_scale=float(ls))
    except ValueError as exc:
        raise CaseFileError(f"{where}: {exc}") from None


def _int(d, key, default, where, lo):
    if key not in d:
        if default is None:
            raise CaseFileError(f"{where}: '{key}' is required")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > 1 << 31:
        raise CaseFileError(f"{where}: '{key}' should be an int in [{lo}, 2**31], but got {_show(v)}")
    return v


def _dims(d, key, where) -> tuple:
    v = d.get(key, [1])
    if not (isinstance(v, list) and len(v) <= 4 and all(isinstance(x, int) and not isinstance(x, bool)
                                                        and 1 <= x <= 1 << 20 for x in v)):
        raise CaseFileError(f"{where}: '{key}' should be a list of at most 4 ints >= 1 (the leading dims), but got "
                            f"{_show(v)}")
    return tuple(v)


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."
