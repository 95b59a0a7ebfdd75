"""A Hugging Face Trainer run by torchrun on two processes (DDP over gloo) is refused by the record callback before
its first step, on every rank, with a message naming the single-process route; the model is left untouched."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

TESTS = Path(__file__).parent

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    import influkit as ik
    from influkit import hf
    from transformers import BertForMaskedLM, DataCollatorForLanguageModeling, Trainer
    import test_hf_trainer_record as t

    tokenizer = hf.wordpiece_tokenizer(t.VOCAB)  # as its fixture builds it
    torch.manual_seed(0)
    model = BertForMaskedLM(t.config(tokenizer)).double()
    before = {{n: p.detach().clone() for n, p in model.named_parameters()}}
    trainer = Trainer(model, t.arguments(), train_dataset=t.examples(tokenizer, t.TEXTS * 2),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3),
                      callbacks=[hf.RecordCallback(ik.unrolled.Record())])
    rank = os.environ["RANK"]
    try:
        trainer.train()
        message = "trained"
    except ik.NotReplayable as error:
        message = f"refused: {{error}}"
    untouched = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    open(os.path.join({out!r}, "rank" + rank), "w").write(f"{{untouched}}|{{trainer.state.global_step}}|{{message}}")
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_multi_process_trainer_is_refused_before_its_first_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), out=str(tmp_path)))
    env = os.environ | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        untouched, steps, message = (tmp_path / f"rank{rank}").read_text().split("|", 2)
        assert untouched == "True" and steps == "0"
        assert message.startswith("refused: the Trainer runs on 2 processes")
        assert "--nproc_per_node=1" in message and "metagradients" in message
