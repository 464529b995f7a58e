"""Installs the kvwire test fault named by ``KVWIRE_TESTING_FAULT`` in every Python process of
a ``vllm serve`` started with this directory on ``PYTHONPATH`` (the API server and the engine
core, where the connector's worker runs). Used by ``test_vllm_serve`` on its prefill
instance only; never on a production path."""

import os

if os.environ.get("KVWIRE_TESTING_FAULT"):
    from kvwire.testing import faults

    faults.apply(os.environ["KVWIRE_TESTING_FAULT"], "prefill")
