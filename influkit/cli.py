"""The ``influkit`` command line: a digits demo, its validation and data cleansing, scoring jobs, gradient indexes,
report pages.

``influkit demo`` runs the multi-stage paper's Case 1 experiment on scikit-learn digits end to end: pretrain a
CNN embedding on digits 0–3, finetune a new head on 4–9, score every pretraining example against the test
set, validate by leave-out retraining, print a table and write the scatter plot and the image gallery; by
default a smaller problem, ``influkit demo --full`` the paper-size run. ``validate`` is the leave-out (or LDS)
harness on the same experiment, ``clean`` removes the most harmful pretraining digits and retrains, ``score``
runs a scoring job from a config file, ``index`` builds or queries a gradient index of a job's stage 1
(:mod:`influkit.index`) and ``report`` renders a saved result as an HTML page. Every option is
checked when parsed: a bad value ends with a message naming the option, before any work starts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .apps.demo_defaults import DEMO_REMOVALS, DEMO_SETTINGS, FULL_REMOVALS
from .errors import InfluenceError
from .solvers import REGISTRY

if TYPE_CHECKING:  # the digits experiment loads on demand, in the commands that run it
    from .apps.digits import DigitsSetup

LDS_SUBSETS = 50  # validate --lds with no M: random halves of the pretraining set
LDS_N_PRETRAIN, LDS_N_FINETUNE = 200, 200  # validate --lds: digits_lds's split when --n-pretrain is not given


def _number(kind, low, high=None, *, open_low=False, open_high=False):
    """An argparse ``type``: ``kind``(text) in [low, high] (open ends where asked), else an error naming the range."""
    left, right = "(" if open_low else "[", ")" if open_high else "]"
    span = f"in {left}{low}, {high}{right}" if high is not None else (f"> {low}" if open_low else f"≥ {low}")
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{noun} {span} is needed, got {text!r}") from None
        if (value <= low if open_low else value < low) or (
                high is not None and (value >= high if open_high else value > high)) or value != value:
            raise argparse.ArgumentTypeError(f"{noun} {span} is needed, got {text}")
        return value

    return parse


def _device(text: str) -> str:
    """An argparse ``type``: a torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device name (cpu, cuda, cuda:1, mps, ...)") from None
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not available here ({str(exc).splitlines()[0]}); "
                                         "use cpu") from None
    return text


def _setup(args) -> DigitsSetup:
    from .apps.digits import DigitsSetup

    common = dict(case=args.case, alpha=args.alpha, n_test=args.n_test, n_pretrain=args.n_pretrain,
                  seed=args.seed, device=args.device)
    if args.command == "demo":
        return DigitsSetup.demo(full=args.full, **common)
    return DigitsSetup(**{k: v for k, v in common.items() if v is not None})


def _phase(name: str, seconds: float) -> None:
    print(f"[{name}] {seconds:.1f} s", flush=True)


def _announce_demo(args, setup: DigitsSetup) -> None:
    n = setup.n_pretrain or 720
    size = (f"Case {setup.case}, {n} pretraining digits, {args.removals} leave-out retrainings, "
            f"‖∇‖ ≤ {setup.tol:g}, {torch.get_num_threads()} torch thread(s)")
    more = "" if args.full else "; --full for the paper-size run"
    print(f"influkit demo{' --full' if args.full else ''}: {size}{more}", flush=True)
    print("phases: [train] both stages to a stationary point, [score] every pretraining digit (and the identity "
          "ablation), [validate] leave-out retraining; each prints its seconds when done", flush=True)


def _print_validation(run, name: str, out: Path) -> None:
    attrs = run.summary.attrs
    print(f"\n== {name}: Case {run.setup.case}, {len(run.pretrain)} pretraining digits "
          f"{run.setup.pretrain_classes} -> finetuning {run.setup.finetune_classes} ==")
    print(f"finetuned test accuracy {attrs['finetune_test_accuracy']:.3f}; pretraining ‖∇G‖ = {attrs['pretrain_grad_norm']:.1e}")
    print(run.summary.drop(columns="case").to_string(float_format=lambda v: f"{v:.3f}"))
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in attrs["timings"].items()))
    for solve in attrs["solves"]:
        print(f"{('pretraining', 'finetuning')[solve['stage']]} solve: {solve['solver']}, {solve['iterations']} it, "
              f"residual {solve['residual']:.1e}, {solve['seconds']:.2f} s")
    print("most harmful pretraining examples:")
    print(run.scores.top(5).to_string(index=False))
    print("most helpful pretraining examples:")
    print(run.scores.top(5, harmful=False).to_string(index=False))
    print(f"wrote {out}/{name}_scatter.png, {name}_gallery.png, {name}_report.html (open it in a browser) and CSVs")


def _add_common(p: argparse.ArgumentParser, removals: int | None, removals_help: str,
                n_pretrain_default: str = "all 720") -> None:
    count = _number(int, 1)
    p.add_argument("--case", type=int, default=1, choices=(1, 2),
                   help="1: the embedding fixed while finetuning; 2: finetuned too, with a proximal term (default 1)")
    p.add_argument("--alpha", type=_number(float, 0, open_low=True), default=None,
                   help="Case 2's proximal weight α > 0 (default 0.01; --case 2 only)")
    p.add_argument("--removals", type=count, default=removals, help=removals_help)
    p.add_argument("--n-test", type=count, default=300,
                   help="test digits (4–9) the scores are taken against (default 300)")
    p.add_argument("--n-pretrain", type=count, default=None,
                   help=f"pretraining digits (0–3), a seeded subsample (default: {n_pretrain_default})")
    p.add_argument("--solver", default="direct", choices=("auto", *sorted(REGISTRY)), metavar="SOLVER",
                   help="the inverse-Hessian solve of both stages, one of: auto, " + ", ".join(sorted(REGISTRY))
                        + " (default direct)")
    p.add_argument("--seed", type=_number(int, 0), default=0,
                   help="seed of the data split and of the random half of the removals (default 0)")
    p.add_argument("--device", type=_device, default="cpu", help="torch device to run on (default cpu)")
    p.add_argument("--out", type=Path, default=Path("influkit-results"),
                   help="folder the tables, plots and pages are written to (default influkit-results)")
    p.add_argument("--threads", type=count, default=None,
                   help="torch threads (demo default: 1; others: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _command(sub, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose ``text`` is both its line in ``influkit --help`` and its own ``--help`` description."""
    command = sub.add_parser(name, help=text, description=text, allow_abbrev=False)
    command.set_defaults(command_parser=command)  # its errors name it: "influkit demo: error: ..."
    return command


def parser() -> argparse.ArgumentParser:
    """The ``influkit`` argument parser: every command, every option with its help and its checked range."""
    top = argparse.ArgumentParser(prog="influkit", description=__doc__.split("\n\n")[0].replace("``", ""),
                                  allow_abbrev=False)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = _command(sub, "demo", "the multi-stage experiment on digits end to end (Case 1 by default): train both "
                                 "stages, score every pretraining digit, validate by leave-out retraining, write "
                                 "plots and a page (--full: the paper-size run)")
    _add_common(demo, removals=None, removals_help=f"leave-out retrainings (half top-|score|, half random); default "
                f"{DEMO_REMOVALS}, with --full {FULL_REMOVALS}",
                n_pretrain_default=f"{DEMO_SETTINGS['n_pretrain']}, with --full all 720")
    demo.add_argument("--full", action="store_true",
                      help=f"the paper-size run: all 720 pretraining digits, {FULL_REMOVALS} removals, ‖∇‖ ≤ 1e-10 "
                           "(studies/results/digits/case1_*)")
    demo.set_defaults(threads=1)
    validate = _command(sub, "validate", "the leave-out (or, with --lds, the linear datamodeling) harness on the "
                                         "digits two-stage experiment")
    _add_common(validate, removals=60, removals_help="leave-out retrainings (half top-|score|, half random; "
                "default 60)", n_pretrain_default=f"all 720; with --lds {LDS_N_PRETRAIN}")
    validate.add_argument("--log", type=Path, default=None, help="CSV to append LOO rows to (resumable)")
    validate.add_argument("--lds", type=_number(int, 3), nargs="?", const=LDS_SUBSETS, default=None, metavar="M",
                          help="linear datamodeling score instead of LOO: M ≥ 3 random halves of the pretraining "
                               f"set (default {LDS_SUBSETS}; --n-pretrain default {LDS_N_PRETRAIN}), both stages re-trained "
                               "from scratch with 2 seeds; --log is then the resumable run directory")
    clean = _command(sub, "clean", "remove the most harmful pretraining digits, retrain, compare with removing "
                                   "as many at random")
    _add_common(clean, removals=None, removals_help="pretraining examples removed per seed (the top-k harmful "
                "by score vs k at random); default: --fraction of the pretraining set")
    clean.add_argument("--fraction", type=_number(float, 0, 1, open_low=True, open_high=True), default=0.1,
                       help="fraction in (0, 1) removed when --removals is not given (default 0.1)")
    clean.add_argument("--seeds", type=_number(int, 1), default=5, help="repetitions, one split seed each (default 5)")
    score = _command(sub, "score", "run a scoring job from a TOML/YAML config (works under torchrun)")
    score.add_argument("config", type=Path, help="the job's config file (see influkit.jobs)")
    score.add_argument("--quiet", action="store_true", help="no progress bars")
    index = _command(sub, "index", "build or query a gradient index from a TOML/YAML config (influkit.index.job)")
    index.add_argument("action", choices=("build", "query"), help="build (or resume, or append to) the index of "
                       "stage 1; query it with the chain's test set")
    index.add_argument("config", type=Path, help="the job's config file with an [index] table")
    index.add_argument("--quiet", action="store_true", help="no progress bars")
    explain = _command(sub, "explain", "the top training texts of prompt + completion queries, tokens shaded by "
                                       "their per-token scores, from a TOML job file (influkit.hf.texts)")
    explain.add_argument("config", type=Path, help="the job's TOML file (model, corpus, queries, k, out, ...)")
    explain.add_argument("--quiet", action="store_true", help="no progress bars")
    page = _command(sub, "report", "a self-contained HTML page of a saved result (influkit.report)")
    page.add_argument("result", type=Path, help="a result file written by InfluenceResult.save")
    page.add_argument("-o", "--output", type=Path, default=None, help="the HTML file (default: RESULT.html)")
    page.add_argument("--top", type=_number(int, 1), default=None, help="examples per list (default: as stored, "
                      "else 8; examples the result did not store show as ids)")
    page.add_argument("--max-queries", type=_number(int, 1), default=None,
                      help="test columns shown (default: as stored, else 12)")
    page.add_argument("--title", default=None,
                      help="the page's title (default: as stored, else 'influence report — METHOD')")
    return top


def _check_sizes(args) -> None:
    """Refuse sizes the digits cannot supply (a subsample larger than its pool would silently shrink)."""
    from .apps.datasets import load_digits_tensors
    from .apps.digits import DigitsSetup

    error = args.command_parser.error
    if args.alpha is not None and args.case != 2:
        error("argument --alpha: the proximal weight of Case 2; add --case 2 or leave --alpha out")
    _, y = load_digits_tensors()
    setup = DigitsSetup()
    pool = int(sum((y == c).sum() for c in setup.pretrain_classes))
    finetune_pool = int(sum((y == c).sum() for c in setup.finetune_classes))
    lds = args.command == "validate" and args.lds
    if args.n_pretrain is not None:
        n_pretrain = args.n_pretrain
    elif lds:
        n_pretrain = LDS_N_PRETRAIN
    elif args.command == "demo" and not args.full:
        n_pretrain = DEMO_SETTINGS["n_pretrain"]
    else:
        n_pretrain = pool
    n_finetune = LDS_N_FINETUNE if lds else finetune_pool // 2
    if n_pretrain > pool:
        error(f"argument --n-pretrain: at most {pool} (the pretraining digits 0–3), got {n_pretrain}")
    if args.n_test > finetune_pool - n_finetune:
        error(f"argument --n-test: at most {finetune_pool - n_finetune} (digits 4–9 beside the {n_finetune} "
                  f"finetuning ones), got {args.n_test}")
    removals = args.removals
    if args.command == "demo" and removals is None:
        removals = FULL_REMOVALS if args.full else DEMO_REMOVALS
    if args.command in ("demo", "validate") and not lds and not 2 <= removals <= n_pretrain:
        error(f"argument --removals: between 2 and the {n_pretrain} pretraining digits, got {removals}")
    if args.command == "clean" and args.removals is not None and args.removals >= n_pretrain:
        error(f"argument --removals: fewer than the {n_pretrain} pretraining digits, got {args.removals}")


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.command in ("demo", "validate", "clean"):
        _check_sizes(args)
    try:
        return _run(args)
    except (InfluenceError, OSError) as exc:  # bad input or an unreadable file: its message, not a traceback
        print(f"influkit {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.command == "report":
        from .report import write_report
        from .results import load

        output = args.output or args.result.with_name(args.result.name + ".html")
        path = write_report(load(args.result), output, k=args.top, max_queries=args.max_queries, title=args.title)
        print(f"wrote {path}")
        return 0
    if args.command == "score":
        from .jobs import main as score_main

        return score_main(args.config, quiet=args.quiet)
    if args.command == "explain":
        from .hf.texts import main as explain_main

        return explain_main(args.config, quiet=args.quiet)
    if args.command == "index":
        from .index.job import main as index_main

        return index_main(args.action, args.config, quiet=args.quiet)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.command == "validate" and args.lds:
        from .apps.digits import DigitsSetup, digits_lds

        result = digits_lds(args.case, directory=args.log or args.out / f"lds_case{args.case}_runs",
                            alpha=args.alpha or DigitsSetup.alpha,
                            n_pretrain=args.n_pretrain or LDS_N_PRETRAIN, n_finetune=LDS_N_FINETUNE,
                            n_test=args.n_test, split_seed=args.seed,
                            n_subsets=args.lds, methods=(args.solver, "identity", "gradient dot"), device=args.device,
                            progress=not args.quiet)
        print(result.table.to_string(float_format=lambda v: f"{v:.3f}"))
        print(f"wrote {', '.join(str(p) for p in result.write(args.out, f'lds_case{args.case}'))}")
    elif args.command in ("demo", "validate"):
        from .apps.digits import validate_digits, write_validation

        setup = _setup(args)
        report = None
        if args.command == "demo":
            if args.removals is None:
                args.removals = FULL_REMOVALS if args.full else DEMO_REMOVALS
            _announce_demo(args, setup)
            report = _phase
        run = validate_digits(setup, n_removals=args.removals, solver=args.solver,
                              log=getattr(args, "log", None), progress=not args.quiet, report=report)
        name = f"case{args.case}"
        write_validation(run, args.out, name)
        _print_validation(run, name, args.out)
    else:
        from .apps.cleansing import cleansing_table

        table = cleansing_table(_setup(args), fraction=args.fraction, removals=args.removals, seeds=args.seeds,
                                solver=args.solver, progress=not args.quiet)
        args.out.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out / "cleansing.csv")
        print(table.to_string(float_format=lambda v: f"{v:.4f}"))
    print(f"\ndone in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
