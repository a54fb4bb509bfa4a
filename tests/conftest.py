import os

import pytest
from hypothesis import HealthCheck, settings

# deadline=None: timings on shared 2-core CI machines are too noisy for
# per-example deadlines. "ci" keeps the suite well under its time budget.
# data_too_large: hypothesis 6.50 (the oldest setup.cfg allows) has a smaller example buffer than 6.155, and the
# sinks' problems overran it; a check on generation, not on a result (newer versions never raise it here).
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=30, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=_QUIET)
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


#: Tests marked ``long`` run where SDPA_REF_LONG_CHECKS=1 (a step of .ci/run), not in the default suite, which
#: stays under three minutes on two cores: more dtypes of checks the default suite makes in one or two.
LONG_CHECKS = os.environ.get("SDPA_REF_LONG_CHECKS") == "1"


def pytest_collection_modifyitems(config, items):
    # the tests marked slow first: pytest-xdist hands the workers tests in this order, so the long ones start early
    # and the short ones fill in at the end, rather than one long test keeping a core busy while the other idles
    # (a stable sort: every worker collects the same order, as xdist requires)
    items.sort(key=lambda item: "slow" not in item.keywords)
    if LONG_CHECKS:
        return
    skip = pytest.mark.skip(reason="a longer check, run by .ci/run (SDPA_REF_LONG_CHECKS=1)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
