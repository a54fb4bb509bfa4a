r"""Judging another implementation: the conformance harness's entry points in one place.

:func:`check_implementation` runs a kernel over named cases and judges it
against the reference by a rule (:class:`RelativeRule` by default, the
honest kernels' worst error in the test dtype; :class:`FixedRule`,
:class:`ULPRule`); :func:`assert_conforms` is the same as a pytest check;
:func:`check_merge` judges a merge of split-KV partial results. The cases
are :func:`get_suite`'s (or a file's, :func:`load_cases`); golden vectors
for a kernel in another language are :func:`write_vectors`'s and
:func:`verify_vectors` checks them. Their homes are the modules of
:mod:`sdpa_ref.harness`; ``check_implementation`` and ``assert_conforms``
are also at the top level. Importing this module loads the harness.
"""

from .harness.casefile import load_cases
from .harness.cases import SUITE_VERSION, Case, get_suite
from .harness.conformance import FixedRule, RelativeRule, ULPRule, assert_conforms, check_implementation
from .harness.merge_check import check_merge
from .harness.report import ConformanceReport, ConformanceRow
from .harness.vectors import VerifyReport, verify_vectors, write_vectors

__all__ = [
    "check_implementation",
    "assert_conforms",
    "check_merge",
    "ConformanceReport",
    "ConformanceRow",
    "FixedRule",
    "RelativeRule",
    "ULPRule",
    "SUITE_VERSION",
    "Case",
    "get_suite",
    "load_cases",
    "write_vectors",
    "verify_vectors",
    "VerifyReport",
]
