"""dattri's Data Value Embedding (DVEmb, Wang et al., ICLR 2025; ``dattri==0.3``) as a benchmark peer on a recorded
run (``influkit.unrolled.Record``, one stage), through dattri's own ``DVEmbAttributor`` (nothing of it is copied).

Runs in the bench venv (``bash scripts/bench-env.sh``). DVEmb is derived for SGD,
θ_{t+1} = θ_t − (η_t/B) Σ_{z∈B_t} ∇ℓ_z(θ_t): walking the steps backwards it builds each example's
embedding e_z = Σ_{t: z∈B_t} (η_t/B) (I − M_{>t}) ∇ℓ_z(θ_t), M_{>t} = Σ_{s>t} Σ_{z'∈B_s} e_{z',s} ∇ℓ_{z'}(θ_s)ᵀ
(its ``cache``), and scores e_z · ∇ℓ_test(θ_T) ≈ loss_test(without z) − loss_test(with z). Here it gets the
record's own batches, learning rates and per-step parameters θ_t (the record replayed from its start, exactly as
recorded): on an AdamW record that is DVEmb's SGD-form approximation of the run (Adam's preconditioning, momentum and
weight decay are not in it). Returned as influkit's sign: s_z(t) = d loss_t / d w_z = −e_z · ∇ℓ_t(θ_T).
"""

from __future__ import annotations

import torch

from influkit.unrolled import Record
from influkit.unrolled.replay import start, unit_weights


def dvemb_scores(record: Record, test: tuple[torch.Tensor, torch.Tensor], *, proj_dim: int | None = None,
                 seed: int = 0) -> torch.Tensor:
    """(n, q) s_z(t) = −DVEmb(z, t) of a one-stage record, ℓ the stage's own per-example loss (``stage.losses``,
    on the training examples and on the test set alike); ``proj_dim``: dattri's random projection of the
    gradients (None: the full gradients, whose d × d matrix M DVEmb then holds)."""
    from dattri.algorithm.dvemb import DVEmbAttributor
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader, TensorDataset

    if len(record.runs) != 1:
        raise ValueError(f"DVEmb is single-stage; the record has {len(record.runs)} stages.")
    run = record.runs[0]
    model = run.stage.model

    def loss(params, data):
        x, y = data
        return run.stage.losses(params, x.unsqueeze(0), y.unsqueeze(0)).squeeze(0)

    attributor = DVEmbAttributor(AttributionTask(loss_func=loss, model=model, checkpoints=model.state_dict()),
                                 proj_dim=proj_dim, proj_seed=seed)
    theta, state = start(run, run.anchors), run.checkpoints[0][1]
    for t in range(run.steps):
        idx, x, y = run.batch(t)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(theta[n])
        attributor.cache_gradients(0, (x, y), idx, float(run.lrs[t]))
        theta, state = run.step(t, theta, state, run.anchors, unit_weights(run, idx, None, x), x, y)
    attributor.cache()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(theta[n])
    x_test, y_test = test
    model.eval()
    values = attributor.attribute(DataLoader(TensorDataset(x_test, y_test), batch_size=len(x_test)))
    return -values.detach()
