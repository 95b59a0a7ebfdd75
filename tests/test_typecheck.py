"""scripts/typecheck.py: the README's calls are type-checked against the package, and a wrong argument type fails."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import typecheck  # noqa: E402

PAGE = """Some prose.

```python
import influkit as ik
link = ik.Link("embedding", case={case})
```

More prose.

```python
solve = ik.SolveConfig(damping={damping})
```
"""


def test_page_module_joins_the_blocks_in_order():
    module = typecheck.page_module(PAGE.format(case=1, damping=0.1))
    assert module.index("ik.Link") < module.index("ik.SolveConfig")
    assert "prose" not in module
    compile(module, "page", "exec")


def test_every_module_is_imported_by_its_path():
    imports = typecheck.every_module_import().splitlines()
    assert {"import influkit", "import influkit.chain", "import influkit.unrolled.watch"} <= set(imports)
    assert len(imports) == len([p for p in (ROOT / "influkit").rglob("*.py") if p.name != "__main__.py"])


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy (the dev extra) is not installed")
def test_a_wrong_argument_type_in_a_page_is_caught():
    done = typecheck.check({"right.py": typecheck.page_module(PAGE.format(case=1, damping=0.1)),
                            "wrong.py": typecheck.page_module(PAGE.format(case='"one"', damping='"high"'))})
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert done.returncode == 1
    assert len(errors) == 2 and all("wrong.py" in line and "[arg-type]" in line for line in errors), done.stdout
    assert '"case" to "Link"' in errors[0] and '"damping" to "SolveConfig"' in errors[1]
