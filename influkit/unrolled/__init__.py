"""Unrolled attribution: differentiate the training that actually ran, stage by stage, by exact replay.

``Record`` records training — the user's own ``torch.optim`` loop through ``record.watch(model, optimizer, loader,
loss_fn)`` (dropout, schedulers, clipping, accumulation; :mod:`.watch`), a Hugging Face ``Trainer`` through
``influkit.hf.RecordCallback``, or influkit's own pure steps (``record.train``) — and ``replay`` re-runs it
with other per-example weights, and ``metagradients`` returns d measure(final model) / d w_z for every example
of every stage by reverse mode through the recorded steps (MAGIC-style), the adjoint handed across each
pretrain → finetune boundary. A score is d measure / d w_z at w = 1 (or at the weights ``at=``: the drop sets' mean
1 − f to rank random drops of a fraction f, the midpoint 1 − f/2 to predict one drop's change); removing z predicts
−score. ``sharpness`` puts each checkpoint's largest Hessian eigenvalue (Adam's: of P⁻¹H, its preconditioned
Hessian) beside its learning rate: a run past the edge of stability (SGD η·λ_max > 2(1 + μ); Adam
η·λ_max(P⁻¹H) > 2(1 + β₁)/(1 − β₁)) answers whole-example drops far from linearly, ``linearity`` checks the
answer itself on a few replayed drop sets, and ``diagnose`` reads both and names what to change (a warmup, a lower
learning rate). The user's own loop::

    record = ik.unrolled.Record()
    with record.watch(model, optimizer, loader, loss_fn) as run:   # the loop inside, unchanged
        ...
    scores = ik.unrolled.metagradients(record, (x_test, y_test))[0]

A two-stage record trained by influkit's own optimizers::

    record = ik.unrolled.Record()
    record.train(pre_stage, ik.unrolled.AdamW(lr=1e-2, weight_decay=1e-3), steps=300, batch_size=32)
    record.train(fin_stage, ik.unrolled.SGD(lr=0.1, momentum=0.9), steps=200, batch_size=32,
                 link=ik.Link("embedding", case=1))
    pre_scores, fin_scores = ik.unrolled.metagradients(record, (x_test, y_test), per_test=True)

``first_order`` carries the adjoint through each step's optimizer Jacobian alone (the loss curvature dropped), and
``TrajectoryIndex`` stores its pretraining side once per example, so that every new finetune of a recorded
pretraining (``record.branch()`` continued) is answered by that finetune's own replay plus one product::

    index = ik.unrolled.TrajectoryIndex.build(pretraining, "index-dir")
    pre_scores, fin_scores = index.scores(finetune, (x_test, y_test))
"""

from .boundary import Adjoint
from .firstorder import first_order, first_order_check
from .metagradient import metagradients
from .optimizers import SGD, Adam, AdamW
from .record import Record, StageRecorder
from .run import StageRun
from .replay import outputs, replay, reweighted, verify
from .segments import approximate
from .stability import diagnose, linearity, sharpness
from .trajectory_index import TrajectoryIndex
from .watch import Watch

__all__ = ["Adjoint", "SGD", "Adam", "AdamW", "Record", "approximate", "diagnose", "first_order", "first_order_check",
           "linearity", "StageRecorder",
           "StageRun", "TrajectoryIndex", "Watch", "metagradients", "outputs", "replay", "reweighted", "sharpness", "verify"]
