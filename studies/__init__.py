"""influkit's studies: how well attribution predicts retraining (LDS, replay, leave-out) and the papers' experiments.

The fidelity studies are a package (``python -m studies.fidelity table --task digits-case1``); the paper
experiments are scripts (``python studies/paper_experiments.py case1``). Results go to ``studies/results/``.
"""
