"""influkit's command line: every command and option is described, abbreviations and bad values are refused with a
message naming the option (before any work starts), and bad input files end with their message, not a traceback."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import need

from influkit.cli import main, parser
from influkit.solvers import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "cli.md"
BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
POSITIONALS = {"score": ["job.toml"], "explain": ["job.toml"], "index": ["build", "job.toml"], "report": ["result.safetensors"]}


def commands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def refused(argv, capsys) -> str:
    """The error message of ``influkit ARGV``, which must exit with status 2 before running anything."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_help_describes_every_command_and_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = " ".join(capsys.readouterr().out.split())
    assert len(commands()) >= 5
    for name, command in commands().items():
        assert command.description and f"{name} {' '.join(command.description.split())[:40]}" in top, name
        for action in command._actions:
            assert action.help and action.help.strip(), f"influkit {name} {action.dest} has no help"
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert " ".join(command.description.split()) in " ".join(capsys.readouterr().out.split())


def test_abbreviated_options_are_refused(capsys):
    assert "unrecognized arguments: --removal 5" in refused(["demo", "--removal", "5"], capsys)
    for name, command in commands().items():
        options = {o for a in command._actions for o in a.option_strings}
        for action in command._actions:
            for option in action.option_strings:
                prefix = option[:-1]
                if not option.startswith("--") or prefix in options:
                    continue
                argv = [name, *POSITIONALS.get(name, []), prefix, *([] if action.nargs == 0 else ["1"])]
                assert f"unrecognized arguments: {prefix}" in refused(argv, capsys)


def test_solver_is_one_of_the_registry(capsys):
    assert "argument --solver: invalid choice: 'foo'" in refused(["demo", "--solver", "foo"], capsys)
    for solver in ("auto", *REGISTRY):
        assert parser().parse_args(["clean", "--solver", solver]).solver == solver


@pytest.mark.parametrize("argv,message", [
    (["demo", "--n-pretrain", "0"], "argument --n-pretrain: an integer ≥ 1 is needed, got 0"),
    (["demo", "--n-pretrain", "721"], "argument --n-pretrain: at most 720 (the pretraining digits 0–3), got 721"),
    (["validate", "--n-pretrain", "many"], "argument --n-pretrain: an integer ≥ 1 is needed, got 'many'"),
    (["demo", "--n-test", "0"], "argument --n-test: an integer ≥ 1 is needed"),
    (["demo", "--n-test", "540"], "argument --n-test: at most 539 (digits 4–9 beside the 538 finetuning ones)"),
    (["validate", "--lds", "--n-test", "878"], "argument --n-test: at most 877 (digits 4–9 beside the 200 finetun"),
    (["demo", "--removals", "1"], "argument --removals: between 2 and the 240 pretraining digits, got 1"),
    (["demo", "--full", "--n-pretrain", "30"], "argument --removals: between 2 and the 30 pretraining digits, got 40"),
    (["validate", "--removals", "0"], "argument --removals: an integer ≥ 1 is needed"),
    (["clean", "--n-pretrain", "50", "--removals", "50"], "argument --removals: fewer than the 50 pretraining digits"),
    (["clean", "--fraction", "1"], "argument --fraction: a number in (0, 1) is needed, got 1"),
    (["clean", "--fraction", "nan"], "argument --fraction: a number in (0, 1) is needed, got nan"),
    (["clean", "--seeds", "0"], "argument --seeds: an integer ≥ 1 is needed"),
    (["demo", "--case", "3"], "argument --case: invalid choice: 3"),
    (["demo", "--case", "2", "--alpha", "0"], "argument --alpha: a number > 0 is needed, got 0"),
    (["demo", "--alpha", "0.1"], "argument --alpha: the proximal weight of Case 2; add --case 2"),
    (["demo", "--seed", "-1"], "argument --seed: an integer ≥ 0 is needed, got -1"),
    (["demo", "--threads", "0"], "argument --threads: an integer ≥ 1 is needed"),
    (["demo", "--device", "gpu0"], "argument --device: 'gpu0' is not a torch device name"),
    (["validate", "--lds", "2"], "argument --lds: an integer ≥ 3 is needed, got 2"),
    (["report", "r.safetensors", "--top", "0"], "argument --top: an integer ≥ 1 is needed"),
    (["report", "r.safetensors", "--max-queries", "-2"], "argument --max-queries: an integer ≥ 1 is needed"),
])
def test_bad_values_are_refused_naming_the_option(argv, message, capsys):
    need("sklearn")  # the sizes are checked against the digits
    error = refused(argv, capsys)
    assert message in error and error.startswith(f"influkit {argv[0]}: error: "), error


def test_cli_error_prints_the_message_and_exits_non_zero(tmp_path):
    bad = tmp_path / "scores.safetensors"
    bad.write_text("not an influkit file")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    for path, message in ((bad, "is not an influkit file"), (tmp_path / "missing.safetensors", "does not exist")):
        done = subprocess.run([sys.executable, "-m", "influkit", "report", str(path)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 2
        assert done.stderr.startswith("influkit report: error: ") and message in done.stderr
        assert "Traceback" not in done.stderr and done.stdout == ""


def guide_commands() -> list[str]:
    """The ``influkit`` lines of the guide's bash blocks that run (not after a ``<!-- no-run: REASON -->`` line)."""
    text, lines = GUIDE.read_text(), []
    for match in BASH.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if "no-run" in before:
            assert re.search(r"<!--\s*no-run:\s*\S.*-->", before), f"a no-run marker without its reason: {before}"
            continue
        lines += [line for line in match.group(1).splitlines() if line.strip()]
    assert all(line.startswith("influkit ") for line in lines), lines
    return lines


@pytest.mark.slow
def test_guide_examples_run(tmp_path, monkeypatch, capsys):
    """docs/guides/cli.md's runnable examples, in order: --help, a small demo, the report page of its result."""
    need("sklearn"), need("matplotlib")
    monkeypatch.chdir(tmp_path)
    commands = guide_commands()
    assert [c.split()[1] for c in commands] == ["--help", "demo", "report"]
    for command in commands:
        try:
            assert main(shlex.split(command)[1:]) == 0, command
        except SystemExit as done:  # --help
            assert done.code == 0, command
    out = capsys.readouterr().out
    for name in ("case1_scatter.png", "case1_gallery.png", "case1_loo.csv", "case1_report.html", "page.html"):
        assert (tmp_path / "demo" / name).stat().st_size > 0, name
    loo = pd.read_csv(tmp_path / "demo" / "case1_loo.csv")
    assert len(loo) == 6 and {"predicted", "actual", "identity"} <= set(loo.columns)
    assert "multi-stage influence" in out and "digits, Case 1" in (tmp_path / "demo" / "page.html").read_text()
