"""Which suite of cases a result came from: the suites' names and the version of their cases.

A conformance report and a vector set's manifest record both (:mod:`.report`, :mod:`.vectorio`), so that a
result names the cases it holds without importing them; the cases themselves are :mod:`.cases`'.
"""

__all__ = ["SUITES", "SUITE_VERSION"]

#: Bumped whenever the cases of :mod:`.cases` or their inputs change ("2": plain self-attention added; "3": two
#: past a block; "5": the full suite's q_offset, cuDNN ALiBi and topk_length cases, the quick suite unchanged).
SUITE_VERSION = "5"
#: The suites :func:`~.cases.get_suite` builds.
SUITES = ("quick", "full")
