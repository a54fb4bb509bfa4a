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


def pytest_configure(config):
    # Under pytest-xdist the workers are the parallelism: each worker's BLAS gets the cores left to it (one each on
    # 2 cores), as scikit-learn's suite does, rather than every worker starting the BLAS's own threads on every
    # core (2 workers x 2 OpenBLAS threads on 2 cores spun against each other: the suite took 151 s against 136 s
    # with OPENBLAS_NUM_THREADS=1). Tests of the thread settings set their own (in-process with threadpoolctl,
    # or in subprocesses whose environment they give); the package's pool keeps its own count. Where
    # OPENBLAS_NUM_THREADS or OMP_NUM_THREADS is set already, it is left as it is.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"):
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:                                  # the package's dependency, but not a test's requirement
        return
    try:
        cores = len(os.sched_getaffinity(0))             # the CPUs this process may run on (a container's share)
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    n = max(1, cores // int(workers))
    global _BLAS_LIMIT
    _BLAS_LIMIT = threadpool_limits(limits=n, user_api="blas")
    os.environ["OPENBLAS_NUM_THREADS"] = str(n)          # and the processes the tests start (the CLI, examples)


_BLAS_LIMIT = None


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
