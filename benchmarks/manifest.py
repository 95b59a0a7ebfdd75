"""The manifest of a results folder: for each results file, the command that wrote it, the commit, the date, the
machine (CPU model and cores, or the GPU) and the load while it ran.

Every folder under ``benchmarks/results/`` and ``studies/results/`` holds one ``MANIFEST.json``::

    {"entries": [{"files": ["bench_x.txt"], "command": "python -m benchmarks.bench_x --quick",
                  "commit": "96dc2d3", "dirty": false, "date": "2026-11-27T16:40:00+00:00",
                  "machine": "AMD EPYC ... | 2 cores", "device": "cpu", "load": [1.9, 2.1, 2.0],
                  "note": ""}]}

A new entry replaces the older entries for the same files. From a script::

    from benchmarks.manifest import record
    record(RESULTS / "bench_x", ["bench_x.txt"], note="...")   # command = this process's argv

a benchmark that prints its tables keeps them with ``with saved_output(RESULTS / "bench_x", "bench_x.txt"): ...``,
or by hand, for a file written by a command that does not record itself::

    python -m benchmarks.manifest benchmarks/results/bench_x bench_x.txt --command "python -m ..." --load 2.1
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

NAME = "MANIFEST.json"
ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine() -> str:
    """The CPU model and core count of this machine."""
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} | {os.cpu_count()} cores"


def device() -> str:
    """``cpu``, or the name of the CUDA device torch sees."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _this_command() -> str:
    """This process's command line, a module run with ``-m`` written as ``python -m package.module``."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(ROOT) and script.suffix == ".py":
        module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
        return " ".join(["python -m", module, *sys.argv[1:]])
    return " ".join(["python", *sys.argv])


def record(folder: Path | str, files: list[str], command: str | None = None, *, load: list[float] | str | None = None,
           note: str = "", commit: str | None = None, date: str | None = None, machine_name: str | None = None,
           device_name: str | None = None) -> dict:
    """Add (or replace) the entry for ``files`` in ``folder/MANIFEST.json`` and return it. ``load`` defaults to the
    1-, 5- and 15-minute load averages now (call it when the run ends). ``commit``, ``date``, ``machine_name`` and
    ``device_name`` default to this checkout and this machine now; give them (or ``"unknown"``) when recording a file
    written earlier."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entry = {
        "files": sorted(files),
        "command": command if command is not None else _this_command(),
        "commit": commit if commit is not None else _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")) if commit is None else False,
        "date": date if date is not None else datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_name if machine_name is not None else machine(),
        "device": device_name if device_name is not None else device(),
        "load": load if isinstance(load, str) else [round(x, 2) for x in (load if load is not None else os.getloadavg())],
        "note": note,
    }
    path = folder / NAME
    entries = json.loads(path.read_text())["entries"] if path.exists() else []
    entries = [e for e in entries if not set(e["files"]) & set(files)] + [entry]
    path.write_text(json.dumps({"entries": sorted(entries, key=lambda e: e["files"])}, indent=1) + "\n")
    return entry


class _Both:
    """A text stream that writes to the terminal and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, []

    def write(self, text: str) -> int:
        self.copy.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def saved_output(folder: Path | str, name: str, note: str = ""):
    """Print as usual inside the block and keep a copy: on leaving it, write ``folder/name`` and record it (command =
    this process's argv, load = now). A block left by an error still writes what it printed, recorded with a note."""
    folder = Path(folder)
    both, before = _Both(sys.stdout), sys.stdout
    sys.stdout = both
    failed = True
    try:
        yield folder / name
        failed = False
    finally:
        sys.stdout = before
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("".join(both.copy))
        record(folder, [name], note=("stopped by an error; " if failed else "") + note)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Record a results file's command, commit, date, machine and load.")
    parser.add_argument("folder", help="the results folder (its MANIFEST.json is created or updated)")
    parser.add_argument("files", nargs="+", help="the files of that folder the entry describes")
    parser.add_argument("--command", required=True, help="the command that wrote them")
    parser.add_argument("--load", nargs="+", help="the load average while it ran (default: now), or 'unknown'")
    parser.add_argument("--note", default="", help="anything a reader needs to know (e.g. what ran beside it)")
    parser.add_argument("--commit", help="the commit that wrote them (default: HEAD), or 'unknown'")
    parser.add_argument("--date", help="when they were written (default: now), or 'unknown'")
    parser.add_argument("--machine", help="the CPU and cores they were measured on (default: this machine), or 'unknown'")
    parser.add_argument("--device", help="cpu or the GPU (default: what torch sees here), or 'unknown'")
    args = parser.parse_args(argv)
    load = None if args.load is None else args.load[0] if args.load == ["unknown"] else [float(x) for x in args.load]
    entry = record(args.folder, args.files, args.command, load=load, note=args.note, commit=args.commit,
                   date=args.date, machine_name=args.machine, device_name=args.device)
    print(json.dumps(entry, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
