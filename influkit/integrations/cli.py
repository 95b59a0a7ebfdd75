"""The ``influkit`` command: ``demo`` (the main job), ``validate`` (LOO harness) and ``clean`` (data cleansing).

``influkit demo`` runs the multi-stage paper's Case 1 experiment on scikit-learn digits end to end: pretrain a
CNN embedding on digits 0–3, finetune a new head on 4–9, score every pretraining example against the test
set, validate by leave-out retraining, print a table and write the scatter plot and the image gallery.
By default it is a smaller problem that takes about a minute; ``influkit demo --full`` is the paper-size run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from .apps.digits import DEMO_REMOVALS, DigitsSetup, validate_digits, write_validation
from .errors import InfluenceError

# what the demo announces at start, measured on this project's 2-core machine (README "Set-up"): the default run
# took 57–81 s with the machine busy (load 4–5), the --full run 244 s on one idle core and 334 s at load 4.7
DEMO_EXPECTED = {False: "~60–90 s on 2 busy CPU cores", True: "~4 min on an idle CPU core, ~6 min when busy"}


def _setup(args) -> DigitsSetup:
    common = dict(case=args.case, alpha=args.alpha, n_test=args.n_test, n_pretrain=args.n_pretrain,
                  seed=args.seed, device=args.device)
    if args.command == "demo":
        return DigitsSetup.demo(full=args.full, **common)
    return DigitsSetup(**common)


def _phase(name: str, seconds: float) -> None:
    print(f"[{name}] {seconds:.1f} s", flush=True)


def _announce_demo(args, setup: DigitsSetup) -> None:
    n = setup.n_pretrain or 720
    size = (f"Case {setup.case}, {n} pretraining digits, {args.removals} leave-out retrainings, "
            f"‖∇‖ ≤ {setup.tol:g}, {torch.get_num_threads()} torch thread(s)")
    if args.full:
        print(f"influkit demo --full: {DEMO_EXPECTED[True]} ({size})", flush=True)
    else:
        print(f"influkit demo: {DEMO_EXPECTED[False]} ({size}); --full for the paper-size run "
              f"({DEMO_EXPECTED[True]})", flush=True)
    print("phases: [train] both stages to a stationary point, [score] every pretraining digit (and the identity "
          "ablation), [validate] leave-out retraining", flush=True)


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


def _add_common(p: argparse.ArgumentParser, removals: int | None,
                removals_help: str = "leave-out retrainings (half top-|score|, half random)") -> None:
    p.add_argument("--case", type=int, default=1, choices=(1, 2))
    p.add_argument("--alpha", type=float, default=0.01, help="Case 2 proximal weight")
    p.add_argument("--removals", type=int, default=removals, help=removals_help)
    p.add_argument("--n-test", type=int, default=300)
    p.add_argument("--n-pretrain", type=int, default=None, help="subsample the pretraining set")
    p.add_argument("--solver", default="direct", help="direct | cg | minres | ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("influkit-results"))
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (demo default: 1, since two threads on a busy 2-core machine ran its "
                        "training >8x slower; others: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="influkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="Case 1 on digits: train, score, validate by LOO, plots (about a minute; "
                                       "--full: the paper-size run, several minutes)")
    _add_common(demo, removals=None, removals_help=f"leave-out retrainings (half top-|score|, half random); default "
                f"{DEMO_REMOVALS}, with --full 40")
    demo.add_argument("--full", action="store_true",
                      help="the paper-size run: all 720 pretraining digits, 40 removals, ‖∇‖ ≤ 1e-10 "
                           "(studies/results/digits/case1_*)")
    demo.set_defaults(threads=1)
    validate = sub.add_parser("validate", help="the LOO harness on the digits two-stage experiment")
    _add_common(validate, removals=60)
    validate.add_argument("--log", type=Path, default=None, help="CSV to append LOO rows to (resumable)")
    validate.add_argument("--lds", type=int, nargs="?", const=50, default=None, metavar="M",
                          help="linear datamodeling score instead of LOO: M random halves of the pretraining set "
                               "(default 50; --n-pretrain default 200), both stages re-trained from scratch with 2 "
                               "seeds; --log is then the resumable run directory")
    clean = sub.add_parser("clean", help="remove the most harmful pretraining examples, retrain, compare")
    _add_common(clean, removals=None, removals_help="pretraining examples removed per seed (the top-k harmful "
                "by score vs k at random); default: --fraction of the pretraining set")
    clean.add_argument("--fraction", type=float, default=0.1, help="fraction removed when --removals is not given")
    clean.add_argument("--seeds", type=int, default=5)
    score = sub.add_parser("score", help="run a scoring job from a TOML/YAML config (works under torchrun)")
    score.add_argument("config", type=Path, help="the job's config file (see influkit.jobs)")
    score.add_argument("--quiet", action="store_true", help="no progress bars")
    index = sub.add_parser("index", help="build or query a gradient index from a TOML/YAML config (influkit.index.job)")
    index.add_argument("action", choices=("build", "query"), help="build (or resume, or append to) the index of "
                       "stage 1; query it with the chain's test set")
    index.add_argument("config", type=Path, help="the job's config file with an [index] table")
    index.add_argument("--quiet", action="store_true", help="no progress bars")
    page = sub.add_parser("report", help="a self-contained HTML page of a saved result (influkit.report)")
    page.add_argument("result", type=Path, help="a result file written by InfluenceResult.save")
    page.add_argument("-o", "--output", type=Path, default=None, help="the HTML file (default: RESULT.html)")
    page.add_argument("--top", type=int, default=None, help="examples per list (default: as stored, else 8; "
                      "examples the result did not store show as ids)")
    page.add_argument("--max-queries", type=int, default=None, help="test columns shown (default: as stored, else 12)")
    page.add_argument("--title", default=None)
    args = parser.parse_args(argv)
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
    if args.command == "index":
        from .index.job import main as index_main

        return index_main(args.action, args.config, quiet=args.quiet)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.command == "validate" and args.lds:
        from .apps.digits import digits_lds

        result = digits_lds(args.case, directory=args.log or args.out / f"lds_case{args.case}_runs", alpha=args.alpha,
                            n_pretrain=args.n_pretrain or 200, n_test=args.n_test, split_seed=args.seed,
                            n_subsets=args.lds, methods=(args.solver, "identity", "gradient dot"), device=args.device,
                            progress=not args.quiet)
        print(result.table.to_string(float_format=lambda v: f"{v:.3f}"))
        print(f"wrote {', '.join(str(p) for p in result.write(args.out, f'lds_case{args.case}'))}")
    elif args.command in ("demo", "validate"):
        setup = _setup(args)
        report = None
        if args.command == "demo":
            if args.removals is None:
                args.removals = 40 if args.full else DEMO_REMOVALS
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
