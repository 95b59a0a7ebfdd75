"""The quick ``influkit demo``'s settings: constants only, so the CLI reads them to build its help without loading
the digits experiment (:mod:`influkit.apps.digits`, which loads pandas, the validation package and the data)."""

DEMO_SETTINGS = dict(n_pretrain=240, tol=1e-8, warmup=100)
"""What the quick ``influkit demo`` changes from the full-size ``DigitsSetup`` (``DigitsSetup.demo()``)."""
DEMO_REMOVALS = 20
"""Leave-out retrainings of the quick demo (10 top-|score|, 10 random)."""
FULL_REMOVALS = 40
"""Leave-out retrainings of ``influkit demo --full``."""
