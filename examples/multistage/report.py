"""An influence report page of a real result: the quick demo's Case 1 run on scikit-learn digits.

Runs ``influkit demo``'s experiment (240 pretraining digits 0–3, a head finetuned on 4–9, 300 test digits,
20 leave-out retrainings; about a minute), then writes the HTML page of its scores with the pretraining digits
as thumbnails, the first test digits as the queries and the leave-out validation, saves the result (so
``influkit report OUT/case1_result.safetensors`` renders the page again) and, when Chromium is installed,
a screenshot of the page (``docs/report.png`` was made this way).

    python examples/multistage/report.py [--out influkit-results/report] [--screenshot docs/report.png]

``--quick`` runs a smaller problem (60 pretraining, 60 finetuning and 30 test digits, 6 leave-out retrainings).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from influkit.apps.demo_defaults import DEMO_REMOVALS
from influkit.apps.digits import DigitsSetup, report_page, validate_digits
from influkit.report import screenshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("influkit-results/report"))
    parser.add_argument("--screenshot", type=Path, default=None, help="PNG of the page (default: OUT/report.png)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--quick", action="store_true", help="60 pretraining, 60 finetuning, 30 test digits, "
                        "6 leave-out retrainings (CI size)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setup = DigitsSetup.demo(**(dict(n_pretrain=60, n_finetune=60, n_test=30) if args.quick else {}))
    run = validate_digits(setup, n_removals=6 if args.quick else DEMO_REMOVALS, progress=not args.quiet)
    page = args.out / "case1_report.html"
    saved = report_page(run, page).save(args.out / "case1_result.safetensors")  # renders the same page again
    print(f"wrote {page} and {saved}")
    if shutil.which("chromium"):
        png = screenshot(page, args.screenshot or args.out / "report.png", size=(1100, 1900))
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
