"""Hypothesis profiles for the property suite.

``ci`` (the default): derandomized, so every CI run draws the same examples, and bounded so the whole
suite stays under 3 minutes on the 2-core CI machine with ``pytest -n 2`` (interpreter grids are
kept to a few programs).  ``long``: random examples, ~25x as many, for manual runs::

    HYPOTHESIS_PROFILE=long python -m pytest -n 2 tests/properties
"""

import os

from hypothesis import HealthCheck, settings

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=10, suppress_health_check=_QUIET, print_blob=True
)
settings.register_profile("long", deadline=None, max_examples=250, suppress_health_check=_QUIET, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
