"""influkit.apps.digits and the ``influkit demo`` command: the two-stage digits experiment end to end."""

from __future__ import annotations

import pandas as pd
import pytest

from conftest import need

need("sklearn"), need("matplotlib")  # the digits experiment and its plots (influkit[apps])

import influkit.cli


def test_demo_setup_quick_and_full():
    from influkit.apps.demo_defaults import DEMO_SETTINGS
    from influkit.apps.digits import DigitsSetup

    full = DigitsSetup.demo(full=True, case=2, n_pretrain=None)
    assert full == DigitsSetup(case=2)  # --full is the paper-size run; None overrides are ignored
    quick = DigitsSetup.demo(n_pretrain=None)
    assert {k: getattr(quick, k) for k in DEMO_SETTINGS} == DEMO_SETTINGS
    assert quick.n_pretrain < 720 and quick.warmup > 0
    assert DigitsSetup.demo(n_pretrain=100).n_pretrain == 100


@pytest.mark.parametrize("extra, removals, n_pretrain", [([], 20, 240), (["--full"], 40, None), (["--removals", "8"], 8, 240)])
def test_cli_demo_announces_and_chooses_size(monkeypatch, capsys, extra, removals, n_pretrain):
    seen = {}

    def fake_validate(setup, *, n_removals, report, **kw):
        seen.update(setup=setup, n_removals=n_removals)
        report("train", 1.25)
        raise KeyboardInterrupt  # stop before any work

    import influkit.apps.digits

    monkeypatch.setattr(influkit.apps.digits, "validate_digits", fake_validate)  # the CLI imports it when run
    with pytest.raises(KeyboardInterrupt):
        influkit.cli.main(["demo", "--quiet", *extra])
    out = capsys.readouterr().out.splitlines()
    assert seen["n_removals"] == removals and seen["setup"].n_pretrain == n_pretrain
    assert out[0].startswith("influkit demo") and ("--full" in out[0])  # the run's size first
    assert "[train] 1.2 s" in out


def test_warm_newton_recipe_reaches_the_same_leave_out_optimum():
    from dataclasses import replace

    from influkit.apps.digits import DigitsSetup, train_stages
    from influkit.chain import Chain
    from influkit.validation.loo import summed_test_loss
    from influkit.validation.retrain import kept

    setup = DigitsSetup(n_pretrain=60, n_finetune=60, n_test=30, channels=(2, 4))
    split = setup.split()
    pre, fin = train_stages(setup, split)
    chain = Chain([pre, fin], [setup.link()])

    def retrain(retrainer, removed):
        stages, norms = retrainer(chain, kept(len(pre), [removed]))
        return norms[0], summed_test_loss(stages[-1], split.test)

    plain, warm = setup.retrainer(), replace(setup, warmup=30).retrainer()
    agreed = 0
    for removed in range(4):
        (g_plain, loss_plain), (g_warm, loss_warm) = retrain(plain, removed), retrain(warm, removed)
        if g_plain <= setup.tol and g_warm <= setup.tol:  # both at a stationary point of the leave-out objective
            assert abs(loss_plain - loss_warm) < 1e-7 * abs(loss_plain)
            agreed += 1
    assert agreed >= 2
