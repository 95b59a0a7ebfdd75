"""``influkit index build CONFIG`` and ``influkit index query CONFIG``: a gradient index described in the job file
of ``influkit score`` (:mod:`influkit.jobs`), with an ``[index]`` table::

    factory = "my_job:build"   # build(device) -> {"stages": [...], "links": [...], "test": ...}
    out = "scores"             # where `query` writes its scores (relative to the config file)
    device = "auto"
    [solve]
    solver = "ekfac"
    [index]
    directory = "index"        # the index (relative to the config file)
    dim = 1024                 # and the other IndexConfig settings: projection, whiten, damping, seed, dtype, ...
    top = 20                   # query: also the top 20 re-scored exactly (top.safetensors)

``build`` indexes the factory's stage 1 (whitened, or projected on the eigenbasis: by the EK-FAC of the chain's
stage 1, fitted with the job's ``[curvature]`` settings; resumable; under ``torchrun`` the shards are split over the ranks; run it
again after adding examples to stage 1's data and it appends them); ``query`` runs the chain's solves for the
factory's test set and scores every indexed example by the index: ``out/values.npy`` (rows in example order),
``out/query.safetensors``, and with ``top`` ``out/top.safetensors`` (an InfluenceResult, ``influkit report`` reads it).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from .. import distributed
from ..chain import Chain, Link
from ..errors import InputError
from ..fitted import CurvatureConfig
from ..jobs import configs, factory, read_config
from ..solvers import SolveConfig
from ..stage import Stage
from .gradient_index import GradientIndex, IndexConfig

JOB_KEYS = {"directory", "top"}


def _setup(path: Path):
    config = read_config(path)
    table = dict(config.get("index") or {})
    unknown = sorted(set(table) - JOB_KEYS - set(IndexConfig.__dataclass_fields__))
    if unknown:
        raise InputError(f"{path}: unknown [index] settings {unknown}; known: {sorted(JOB_KEYS | set(IndexConfig.__dataclass_fields__))}.")
    distributed.initialize(timeout_seconds=float(config.get("timeout_seconds", 600)))
    device = distributed.local_device() if config.get("device", "auto") == "auto" else torch.device(config["device"])
    built = factory(config["factory"], path.parent)(device)
    if not isinstance(built, dict) or "stages" not in built:
        raise InputError("the factory must return a dict with 'stages' (and 'links', 'test' for a query).")
    stages, links = list(built["stages"]), list(built.get("links", ()))
    if not all(isinstance(s, Stage) for s in stages) or not all(isinstance(link, Link) for link in links):
        raise InputError("the factory's 'stages' must be influkit.Stage objects and 'links' influkit.Link objects.")
    index_config = IndexConfig(**{k: v for k, v in table.items() if k not in JOB_KEYS})
    return config, table, built, stages, links, index_config, path.parent / table.get("directory", "index")


def build(path: str | Path, *, progress: bool = True) -> GradientIndex:
    """Build (resume, or append to) the index of the config's stage 1."""
    path = Path(path).resolve()
    config, _, _, stages, links, index_config, directory = _setup(path)
    if GradientIndex.exists(directory):
        return GradientIndex.open(directory).append(stages[0], progress=progress)
    factored = None
    if index_config.whiten or index_config.projection in ("eigenbasis", "eigenpairs"):
        chain = Chain(stages, links, solve=configs(SolveConfig, config.get("solve")),
                      curvature=configs(CurvatureConfig, config.get("curvature")))
        factored = chain.curvature(0).approximation("ekfac", progress=progress)
    return GradientIndex.build(stages[0], directory, index_config, factored=factored, progress=progress)


def query(path: str | Path, *, progress: bool = True):
    """(scores of every indexed example, the top-k re-scored or None) for the config's chain and test set."""
    path = Path(path).resolve()
    config, table, built, stages, links, _, directory = _setup(path)
    if "test" not in built:
        raise InputError("the factory must return 'test' (inputs and targets, or indices) to query the index.")
    index = GradientIndex.open(directory)
    chain = Chain(stages, links, solve=configs(SolveConfig, config.get("solve")),
                  curvature=configs(CurvatureConfig, config.get("curvature")))
    start = time.perf_counter()
    q = chain.query(built["test"], per_test=bool(config.get("per_test", False)), progress=progress)
    result = index.scores(q, progress=progress)
    top = index.top(q, int(table["top"])) if table.get("top") else None
    result.diagnostics["seconds"]["job"] = time.perf_counter() - start
    out = path.parent / config.get("out", "scores")
    if distributed.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / "values.npy", result.values.numpy())
        q.save(out / "query.safetensors")
        if top is not None:
            top.save(out / "top.safetensors")
    return result, top


def main(action: str, config: str | Path, *, quiet: bool = False) -> int:
    """The ``influkit index build|query`` command: run it, print a summary on rank 0."""
    if action == "build":
        index = build(config, progress=not quiet)
        if distributed.rank() == 0:
            print(f"{index}: {index.bytes_per_example} bytes per example")
    else:
        result, top = query(config, progress=not quiet)
        if distributed.rank() == 0:
            out = Path(config).resolve().parent / read_config(config).get("out", "scores")
            print(f"{result.method}: {result.values.shape[0]} examples scored from the index in "
                  f"{result.diagnostics['seconds']['index_product']:.3f} s (+ {result.diagnostics['seconds']['index_check']:.3f} s "
                  f"checking checkpoint and data)")
            print("most harmful (index):\n" + result.top(5).to_string(index=False))
            if top is not None:
                print(f"top {top.values.shape[0]} re-scored exactly:\n" + top.to_frame().to_string(index=False))
            print(f"scores: {out}/values.npy; query: {out}/query.safetensors")
    distributed.shutdown()
    return 0
