"""Test helpers for kvwire and its plugins.

* :mod:`kvwire.testing.remote`: run a backend agent in a separate (spawned) process and drive
  it over a pipe, so transfers really cross a process boundary.
* :mod:`kvwire.testing.conformance`: the pytest conformance suite a backend plugin runs
  against itself (see that module's docstring).
"""

from __future__ import annotations

import sys

if "pytest" in sys.modules:  # rewrite the suite's asserts when it is imported under pytest
    import pytest

    pytest.register_assert_rewrite("kvwire.testing.conformance")
