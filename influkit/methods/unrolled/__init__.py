"""Unrolled attribution: differentiate the training that actually ran, stage by stage, by exact replay.

``Record`` records training (pure optimizer steps on data-weighted losses, checkpoints), ``replay`` re-runs it
with other per-example weights, and ``metagradients`` returns d measure(final model) / d w_z for every example
of every stage by reverse mode through the recorded steps (MAGIC-style), the adjoint handed across each
pretrain → finetune boundary. A score is d measure / d w_z at w = 1 (or at the weights ``at=``: the drop sets' mean
1 − f to rank random drops of a fraction f, the midpoint 1 − f/2 to predict one drop's change); removing z predicts
−score. ``sharpness`` puts each checkpoint's largest Hessian eigenvalue beside its learning rate: a run past the
edge of stability (η·λ_max > 2(1 + μ)) answers whole-example drops far from linearly, and ``linearity`` checks
the answer itself on a few replayed drop sets. A two-stage record::

    record = ik.unrolled.Record()
    record.train(pre_stage, ik.unrolled.AdamW(lr=1e-2, weight_decay=1e-3), steps=300, batch_size=32)
    record.train(fin_stage, ik.unrolled.SGD(lr=0.1, momentum=0.9), steps=200, batch_size=32,
                 link=ik.Link("embedding", case=1))
    pre_scores, fin_scores = ik.unrolled.metagradients(record, (x_test, y_test), per_test=True)
"""

from .metagradient import Adjoint, metagradients
from .optimizers import SGD, Adam, AdamW
from .record import Record, StageRecorder, StageRun
from .replay import outputs, replay, reweighted, verify
from .segments import approximate
from .stability import linearity, sharpness

__all__ = ["Adjoint", "SGD", "Adam", "AdamW", "Record", "approximate", "linearity", "StageRecorder", "StageRun", "metagradients", "outputs", "replay", "reweighted", "sharpness", "verify"]
