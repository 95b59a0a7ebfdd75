"""``influkit score CONFIG``: a scoring job described by a TOML (or YAML) file, on one or many processes.

The config names a Python factory that builds the stages, so the job needs no script of its own::

    factory = "my_job:build"   # module:function; the config file's folder is importable
    out = "scores"             # directory for streamed, resumable scores (relative to the config file)
    chunk_size = 256
    per_test = false
    device = "auto"            # "auto": this rank's GPU (LOCAL_RANK) if CUDA is available, else the CPU
    [solve]                    # a SolveConfig for every stage; or [[solve]] tables, one per stage
    solver = "minres"
    damping = 0.01
    [curvature]                # a CurvatureConfig likewise (optional)
    hessian_samples = 1000

``build(device)`` returns a dict with ``stages`` (a list of :class:`~influkit.stage.Stage`), ``links`` (a list
of :class:`~influkit.chain.Link`, may be empty), ``test`` ((inputs, targets) or indices into the last
stage's data) and optionally ``z`` (stage-1 indices to score; default all). Under ``torchrun`` every rank
runs the same job; the process group is joined here (gloo on CPU, NCCL on GPU) and the work is sharded.
Re-running the same command after a crash resumes from the chunks already in ``out``.
"""

from __future__ import annotations

import importlib
import sys
import time
import tomllib
from pathlib import Path

import torch

from . import distributed
from .chain import Chain, Link
from .errors import InputError
from .fitted import CurvatureConfig
from .results import InfluenceResult
from .solvers import SolveConfig
from .stage import Stage

KEYS = {"factory", "out", "chunk_size", "per_test", "device", "solve", "curvature", "timeout_seconds",
        "index"}  # [index]: influkit index build|query (influkit.index.job)


def read_config(path: str | Path) -> dict:
    """The job settings of a TOML (``.toml``) or YAML (``.yaml``/``.yml``, needs PyYAML) file, checked."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file {path} does not exist.")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:
            raise InputError("reading a YAML config needs PyYAML (pip install pyyaml), or write it as TOML.") from exc
        config = yaml.safe_load(path.read_text()) or {}
    else:
        try:
            config = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise InputError(f"{path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(config) - KEYS)
    if unknown:
        raise InputError(f"{path}: unknown settings {unknown}; known: {sorted(KEYS)}.")
    if "factory" not in config or ":" not in str(config["factory"]):
        raise InputError(f"{path}: set factory = \"module:function\" (a function building the stages).")
    return config


def factory(spec: str, folder: Path):
    """The job's factory, the function ``module:function`` named by ``spec``, its module looked up beside the config
    file (``folder``) too."""
    module_name, _, function = spec.partition(":")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"cannot import the factory module {module_name!r} (looked beside the config too): {exc}") from exc
    if not callable(getattr(module, function, None)):
        raise InputError(f"{module_name} has no function {function!r}.")
    return getattr(module, function)


def configs(kind: type, table):
    """One ``kind`` config from a TOML table, one per stage from an array of tables, the default from None."""
    if table is None:
        return kind()
    if isinstance(table, dict):
        return kind(**table)
    return [kind(**entry) for entry in table]


def run(path: str | Path, *, progress: bool = True) -> InfluenceResult:
    """Run the job of the config file ``path`` and return its (memory-mapped) scores; every rank returns them."""
    path = Path(path).resolve()
    config = read_config(path)
    distributed.initialize(timeout_seconds=float(config.get("timeout_seconds", 600)))
    device = distributed.local_device() if config.get("device", "auto") == "auto" else torch.device(config["device"])
    built = factory(config["factory"], path.parent)(device)
    if not isinstance(built, dict) or "stages" not in built or "test" not in built:
        raise InputError("the factory must return a dict with 'stages', 'test' and optionally 'links' and 'z'.")
    stages, links = list(built["stages"]), list(built.get("links", ()))
    if not all(isinstance(s, Stage) for s in stages) or not all(isinstance(link, Link) for link in links):
        raise InputError("the factory's 'stages' must be influkit.Stage objects and 'links' influkit.Link objects.")
    out = path.parent / config.get("out", "scores")
    chain = Chain(stages, links, solve=configs(SolveConfig, config.get("solve")),
                  curvature=configs(CurvatureConfig, config.get("curvature")))
    start = time.perf_counter()
    query = chain.query(built["test"], per_test=bool(config.get("per_test", False)), progress=progress)
    result = query.scores(built.get("z"), chunk_size=int(config.get("chunk_size", 256)), out=out, progress=progress)
    if distributed.rank() == 0:
        query.save(out / "query.safetensors")
    result.diagnostics["seconds"]["job"] = time.perf_counter() - start
    return result


def main(config: str | Path, *, quiet: bool = False) -> int:
    """The ``influkit score`` command: run the job, print a summary on rank 0."""
    result = run(config, progress=not quiet)
    if distributed.rank() == 0:
        out = Path(config).resolve().parent / read_config(config).get("out", "scores")
        chunks = result.diagnostics["chunks"]
        print(f"{result.method}: {result.values.shape[0]} examples scored on {chunks['ranks']} process(es); "
              f"{chunks['computed']} chunks computed, {chunks['reused']} resumed from {out}")
        for solve in result.diagnostics["solves"]:
            print(f"stage {solve['stage']}: {solve['solver']} {solve['choice']}, {solve['iterations']} it, "
                  f"residual {solve['residual']:.1e}, {solve['seconds']:.2f} s")
        print("most harmful:\n" + result.top(5).to_string(index=False))
        print("most helpful:\n" + result.top(5, harmful=False).to_string(index=False))
        print(f"scores: {out}/values.npy (rows in the order of {out}/index.npy); query: {out}/query.safetensors")
    distributed.shutdown()
    return 0
