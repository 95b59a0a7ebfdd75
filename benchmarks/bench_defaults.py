"""Two recipes a new user runs with every solve setting at its default, timed end to end (query + scores).

- ``lm-lora``: the language-model + LoRA recipe (docs/guides/causal-lm-lora.md) at the example's size, ``ik.Chain([pre, fin],
  [hf.lora_link(pre, fin, case=1)]).query(test).scores()``, on the trained models of
  ``examples/lm_pretrain_lora.py`` (pretrained with Adam, adapters fit by L-BFGS; cached by
  ``bench_fidelity_lm.py train``) and that recipe's test completion ("positive:" → " a gorgeous, moving film").
- ``tiny-bert``: the masked-LM → classifier recipe of ``influkit.hf`` (Case 1, ``shared="bert"``) on a tiny BERT
  (hidden 32, 2 layers, ~24k parameters) pretrained with Adam (60 steps) on 128 random-token sentences, its
  encoder copied into the classifier, the head trained with Adam (60 steps); 8 test sentences.

Run it once with the code before a change and once after (``PYTHONPATH=<tree>``); each run prints, per stage,
the solver, iterations, relative residual and converged flag, and, where the code knows it, where the stage
stands. 1 torch thread; the load average is printed beside the seconds.

    python -m benchmarks.bench_defaults lm-lora tiny-bert --tag after
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch

import influkit as ik
from benchmarks.common import bert_mlm_classifier_chain
from influkit import hf

ROOT = Path(__file__).resolve().parent.parent


def lm_lora():
    from studies.fidelity_lm import LMTask

    task = LMTask(progress=False)
    tok = task.data["tokenizer"]
    test = hf.pack(hf.completion_batch(tok, ["positive:"], [" a gorgeous, moving film"], max_length=32))
    return ik.Chain([task.pre, task.fin], [hf.lora_link(task.pre, task.fin, case=1)]), test


def tiny_bert():
    from transformers import BertConfig

    vocab, length = 200, 16
    config = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=length, num_labels=2, attn_implementation="eager")
    gen = torch.Generator().manual_seed(0)

    def sentences(n):
        ids = torch.randint(5, vocab, (n, length), generator=gen)
        ids[:, 0], ids[:, -1] = 2, 3
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def labelled(n):
        batch = sentences(n)
        return batch | {"labels": batch["input_ids"][:, 1] % 2}

    l2 = lambda p: 0.5 * 1e-4 * sum((v**2).sum() for v in p.values())  # noqa: E731
    pretrain, train, test = sentences(128), labelled(64), labelled(8)
    return bert_mlm_classifier_chain(config, pretrain, train, steps=60, lr=3e-3, regularizer=l2), hf.pack(test)


RECIPES = {"lm-lora": lm_lora, "tiny-bert": tiny_bert}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+", choices=sorted(RECIPES))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# influkit from {Path(ik.__file__).parent.parent} {args.tag}")
    for name in args.recipes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            chain, test = RECIPES[name]()
            start = time.perf_counter()
            res = chain.query(test).scores()
            seconds = time.perf_counter() - start
        print(f"{name} {args.tag}: {seconds:.1f} s (query + scores, defaults; load {os.getloadavg()[0]:.1f}), "
              f"p = {chain.dims}", flush=True)
        for k, solve in enumerate(res.diagnostics["solves"]):
            where = (res.diagnostics.get("stages") or [{}] * len(chain))[k]
            print(f"  stage {k}: {solve['solver']} {solve['iterations']} it, residual {solve['residual']:.2e}, converged "
                  f"{solve['converged']}, λ = {solve['damping']:.3g}; {where.get('verdict', '(position not measured)')} "
                  f"r = {where.get('gradient_norm', float('nan')):.2g} θ ∈ [{where.get('min_eigenvalue', float('nan')):.3g}, "
                  f"{where.get('max_eigenvalue', float('nan')):.3g}]; {solve['choice']}", flush=True)


if __name__ == "__main__":
    main()
