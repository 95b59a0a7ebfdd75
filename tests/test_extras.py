"""The optional extras install together: each benchmark peer imports beside the CPU torch, and transformers
still builds its models (a torchvision that fails to import takes ``transformers`` models down with it).

A peer that is not installed is skipped, unless ``INFLUKIT_REQUIRE_PEERS=1`` (scripts/bench-env.sh sets it).
The imports run in a fresh interpreter, so what other tests imported cannot hide a failure.
"""
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

# distribution -> the statement the benchmarks (or influkit.hf) rely on
PEERS = {
    "transformers": "from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast",
    "peft": "from peft import LoraConfig, get_peft_model",
    "kronfluence": "from kronfluence.analyzer import Analyzer; from kronfluence.task import Task",
    "pyDVL": "from pydvl.influence.torch import CgInfluence, DirectInfluence",
    "captum": "from captum.influence import TracInCP",
    "traker": "from trak import TRAKer; from trak.projectors import BasicProjector",
    "dattri": "from dattri.algorithm.influence_function import IFAttributorExplicit",
    "bergson": ("from bergson.magic.trainer import Trainer; from bergson.collection import collect_gradients; "
                "from bergson.query.attributor import Attributor; import faiss"),
}
REQUIRED = os.environ.get("INFLUKIT_REQUIRE_PEERS") == "1"


def installed(distribution):
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def run_fresh(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


BUILD_BERT = ("import torch\n"
              "cfg = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,"
              " intermediate_size=8, max_position_embeddings=16)\n"
              "out = BertForMaskedLM(cfg)(input_ids=torch.tensor([[1, 2, 3]])).logits\n"
              "assert out.shape == (1, 3, 30), out.shape\n")


@pytest.mark.parametrize("distribution", sorted(PEERS))
def test_peer_imports(distribution):
    """Each peer's statement in a fresh interpreter; transformers then also builds a BERT with it (the failure of
    issue 22: PyPI's torchvision for torch 2.13.0 next to the CPU wheel broke this import)."""
    if not installed(distribution):
        if REQUIRED:
            pytest.fail(f"{distribution} is not installed (INFLUKIT_REQUIRE_PEERS=1): pip install -e '.[bench,hf,dev]'")
        pytest.skip(f"{distribution} not installed")
    code = PEERS[distribution] + ("\n" + BUILD_BERT if distribution == "transformers" else "")
    done = run_fresh(code)
    assert done.returncode == 0, f"{code!r} failed:\n{done.stderr[-3000:]}"


def test_torchvision_imports_when_installed():
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision not installed (no extra needs it)")
    done = run_fresh("import torchvision")
    assert done.returncode == 0, (
        "torchvision is installed but does not import beside this torch (a CUDA build next to the CPU wheel?); "
        f"it breaks transformers: pip uninstall torchvision\n{done.stderr[-2000:]}")


# ---- influkit.extras: an optional dependency that is missing names the extra that installs it ----

BLOCKED = {"h5py": ("import influkit.elmo", "elmo"),
           "sklearn": ("from influkit.apps.datasets import load_digits_tensors; load_digits_tensors()", "apps"),
           "matplotlib": ("import influkit.apps.plotting", "plot"),
           "scipy": ("from influkit.unrolled.top import top_directions; top_directions(None, {}, 2, None)",
                     "unrolled")}


@pytest.mark.parametrize("module", sorted(BLOCKED))
def test_a_missing_extra_is_an_influence_error_naming_its_pip_install(module):
    """In a fresh interpreter where ``module`` cannot be imported, using what needs it raises MissingDependencyError."""
    statement, extra = BLOCKED[module]
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "import influkit as ik\n"
            f"try:\n    {statement}\nexcept ik.MissingDependencyError as e:\n"
            "    assert isinstance(e, ik.InfluenceError) and isinstance(e, ImportError); print('ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=os.environ | {"MPLBACKEND": "Agg"})
    assert out.stdout.startswith("ERROR ") and f"pip install 'influkit[{extra}]'" in out.stdout, out.stdout + out.stderr


def test_import_influkit_and_its_core_need_no_extra():
    """The core, ssl, turnover and validation import with h5py, scikit-learn, matplotlib and scipy all missing."""
    code = ("import sys\nfor m in ('h5py', 'sklearn', 'matplotlib', 'scipy'): sys.modules[m] = None\n"
            "import influkit as ik, influkit.ssl, influkit.turnover, influkit.validation, influkit.report\n"
            "print(ik.validation.spearman([1, 2, 3, 4], [1, 3, 2, 4]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) == pytest.approx(0.8, abs=1e-12)  # 1 − 6·Σd²/(n(n²−1)) = 1 − 6·2/60
