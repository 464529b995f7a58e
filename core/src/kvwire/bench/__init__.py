"""kvwire's benchmarks: ``kvwire bench`` (end to end vs the raw backend, fan-out, staging
comparison), ``kvwire bench-backend`` (raw two-process throughput) and ``kvwire
bench-layerwise``. Plugins build their engine benchmarks on :mod:`kvwire.bench.backend`
(``CASES``, ``target_main``, ``await_reply``). Shipped with the package, as the commands are;
the tests' harness stays in :mod:`kvwire.testing`."""
