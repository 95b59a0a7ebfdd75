"""Optional dependencies: each belongs to one extra of ``pip install influkit[...]`` and is imported where it is used.

| module       | package      | extra    | needed by                                              |
|--------------|--------------|----------|--------------------------------------------------------|
| h5py         | h5py         | elmo     | :mod:`influkit.elmo` (allennlp weight and embedding files) |
| sklearn      | scikit-learn | apps     | the digits data of :mod:`influkit.apps` (``influkit demo``) |
| matplotlib   | matplotlib   | plot     | the report page, :mod:`influkit.apps` plots             |
| scipy        | scipy        | unrolled | ``ik.unrolled.approximate(..., top=k)`` (ARPACK's Lanczos) |
| faiss        | faiss-cpu    | index    | approximate top-k search of a gradient index (``ann=True``) |

``pip install influkit`` needs none of them (``apps`` installs ``plot`` too; ``dev`` installs all of them).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

EXTRAS = {"h5py": ("h5py", "elmo"), "sklearn": ("scikit-learn", "apps"), "matplotlib": ("matplotlib", "plot"),
          "scipy": ("scipy", "unrolled"), "faiss": ("faiss-cpu", "index")}


def require(module: str, purpose: str) -> ModuleType:
    """The imported ``module`` (one of ``EXTRAS``' packages), or a MissingDependencyError naming its extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package, extra = EXTRAS[module.split(".")[0]]
        raise MissingDependencyError(
            f"{purpose} needs {package}, which is not installed: pip install 'influkit[{extra}]'."
        ) from exc
