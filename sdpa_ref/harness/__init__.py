"""The harness: named cases, conformance of other implementations, golden vectors and the self-check.

Every part takes its problems from one :class:`~.cases.Case` type.
"""

from .cases import SUITE_VERSION, Case, get_suite
from .grid import gradcheck_grid
from .conformance import FixedRule, RelativeRule, ULPRule, assert_conforms, check_implementation
from .report import ConformanceReport, ConformanceRow

__all__ = [
    "SUITE_VERSION",
    "Case",
    "ConformanceReport",
    "ConformanceRow",
    "FixedRule",
    "RelativeRule",
    "ULPRule",
    "assert_conforms",
    "check_implementation",
    "get_suite",
    "gradcheck_grid",
]
