import os

from hypothesis import HealthCheck, settings

# deadline=None: timings on shared 2-core CI machines are too noisy for
# per-example deadlines. "ci" keeps the suite well under its time budget.
settings.register_profile("ci", max_examples=30, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
