"""influkit's benchmarks, a package: run each from the repository root as ``python -m benchmarks.<module> ...``
(e.g. ``python -m studies.fidelity table --task digits-case1``); modules import their siblings as
``benchmarks.<module>``, never by editing ``sys.path``."""
