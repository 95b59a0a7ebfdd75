"""What recording the user's own torch.optim loop and its exact metagradient cost, against the plain loop.

The MLP of issue 37: pretraining on 2,000 examples (64 features, 10 classes; AdamW, linear warmup, dropout 0.1,
clipping at norm 1, 200 steps of 32), then Case 1 finetuning of a new head on 200 examples (2 classes; SGD + momentum,
100 steps of 32): 300 steps of a 64-128-128 tanh MLP, float32, one thread. In ONE process, interleaved, the fastest
of ``--repeats``:

- plain: the loop with torch.optim and a DataLoader, nothing else;
- recorded: the same loop inside ``record.watch(...)`` (both stages);
- recorded + metagradient: the recorded loop, then ``ik.unrolled.metagradients`` of the summed loss of 100 test
  points (q = 1) — one exact metagradient for every pretraining and finetuning example;
- q measures: ``per_test=True`` over q test points in one pass, against q separate passes of one test point each
  (after one recording), both as seconds and as a ratio;
- a Hugging Face ``Trainer`` run (a tiny BERT's masked-LM training, 32 steps) plain and recorded by
  ``hf.RecordCallback`` (its ratio to the plain Trainer run);
- the tiny GPT-2 run of issue 37: a randomly initialized ``GPT2LMHeadModel`` (2 layers, width 64, 2 heads, untied
  input and output embeddings, dropout 0.1, eager attention; 168 k parameters) trained as a causal LM on 96 real
  snippets (the vaderSentiment tweets, a WordPiece vocabulary of 512 learned from them, at most 32 tokens) for 24
  ``torch.optim.AdamW`` steps of 8 (linear warmup over 4 steps, clipping at norm 1), plain, recorded, and recorded +
  the exact metagradient of 16 held-out snippets' summed loss (ratios to its own plain loop).

The ``ratio before`` column times the reverse pass as it was before its optimization (``metagradient.py`` of commit
``BEFORE``, loaded beside today's and run on the same records, interleaved in the same process), so the change is
visible beside today's ratio; its scores are checked to agree with today's.

Targets (issue 37, item 4): recorded ≤ 1.15× plain (the Trainer's too) and one exact metagradient ≤ 3× plain, the
metagradient timed alone as the issue's 4.2× was (its recorded run replaces the plain one); recorded + metagradient,
the whole cost of an attributed run, is reported beside it. Results: ``benchmarks/results/bench_record_cost/`` (``cost.csv``,
``breakdown.csv``: where one metagradient's time goes, ``cost.png``, ``profile_metagradient.txt`` with
``--profile``, ``MANIFEST.json``).

    python -m benchmarks.bench_record_cost              # 5 repeats, q = 10
    python -m benchmarks.bench_record_cost --quick      # 2 repeats, q = 4
    python -m benchmarks.bench_record_cost --repeats 10 --profile   # the committed results
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import influkit as ik

from .manifest import record as manifest

OUT = Path(__file__).resolve().parent / "results" / "bench_record_cost"
BEFORE = "a21da9b"  # the last commit before the reverse pass was optimized (issue 37, item 4)


class MLP(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.embedding = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Dropout(0.1), nn.Linear(128, 128), nn.Tanh())
        self.head = nn.Linear(128, classes)

    def forward(self, x):
        return self.head(self.embedding(x))


def task():
    """(pretraining set, finetuning set, test set): Gaussian clusters in 64 dimensions, one per class."""
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(10, 64, generator=gen)

    def draw(n, classes):
        y = torch.randint(0, classes, (n,), generator=gen)
        return centres[y] + 1.5 * torch.randn(n, 64, generator=gen), y

    return draw(2000, 10), draw(200, 2), draw(100, 2)


def per_example(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def loop(model, optimizer, loader, steps, *, scheduler=None, clip=None, run=None, params=None, loss=per_example):
    """The user's loop: ``steps`` optimizer steps over the loader's epochs (clipping through ``run`` when watched)."""
    t = 0
    while t < steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss(model(x), y).mean().backward()
            if clip is not None:
                run.clip_grad_norm_(clip) if run is not None else torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            t += 1
            if t == steps:
                return


def train(data, record: ik.unrolled.Record | None):
    """Both stages, plain (``record`` None) or watched; returns the finetuned model."""
    (xp, yp), (xf, yf), _ = data
    torch.manual_seed(0)
    pre = MLP(10)
    opt = torch.optim.AdamW(pre.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 20))
    loader = DataLoader(TensorDataset(xp, yp), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    if record is None:
        loop(pre, opt, loader, 200, scheduler=sched, clip=1.0, params=list(pre.parameters()))
    else:
        with record.watch(pre, opt, loader, per_example) as run:
            loop(pre, opt, loader, 200, scheduler=sched, clip=1.0, run=run)
    fin = MLP(2)
    fin.embedding.load_state_dict(pre.embedding.state_dict())
    opt = torch.optim.SGD(fin.head.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(xf, yf), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(2))
    if record is None:
        loop(fin, opt, loader, 100)
    else:
        with record.watch(fin, opt, loader, per_example, link=ik.Link("embedding", case=1)):
            loop(fin, opt, loader, 100)
    return fin


def trainer_run(record: ik.unrolled.Record | None) -> None:
    """A tiny BERT's masked-LM Trainer run (2 layers, hidden 64; 256 generated sentences, 2 epochs of 16), plain
    or recorded by ``hf.RecordCallback``."""
    import tempfile

    from transformers import (BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, Trainer,
                              TrainingArguments)

    from influkit import hf

    tokenizer, rows = TRAINER_DATA
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=128, max_position_embeddings=32,
                                       attn_implementation="eager"))
    args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=16, num_train_epochs=2,
                             learning_rate=1e-3, warmup_steps=4, optim="adamw_torch", report_to=[],
                             save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    callbacks = [] if record is None else [hf.RecordCallback(record)]
    Trainer(model, args, train_dataset=rows, data_collator=DataCollatorForLanguageModeling(tokenizer),
            callbacks=callbacks).train()


def trainer_data():
    """(tokenizer, rows): 256 sentences of 6-12 words drawn from 200 made-up words, tokenized."""
    from influkit import hf

    gen = torch.Generator().manual_seed(3)
    words = [f"w{i}" for i in range(200)]
    texts = [" ".join(words[j] for j in torch.randint(0, 200, (int(torch.randint(6, 13, (1,), generator=gen)),),
                                                      generator=gen)) for _ in range(256)]
    tokenizer = hf.train_wordpiece(texts, vocab_size=300)
    enc = tokenizer(texts, truncation=True, max_length=16)
    return tokenizer, [{k: enc[k][i] for k in ("input_ids", "attention_mask")} for i in range(len(texts))]


TRAINER_DATA = None
GPT2_DATA = None


def gpt2_data():
    """(train (ids, labels), test (ids, labels), vocabulary size): 96 + 16 tweets of the vaderSentiment snippets,
    WordPiece ids padded to 32 (labels: the ids, −100 on padding)."""
    from influkit import hf

    texts = [s.text for s in hf.rated_snippets(["tweets"])[:112]]
    tokenizer = hf.train_wordpiece(texts, vocab_size=512, min_frequency=1)
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=32, return_tensors="pt")
    ids = enc["input_ids"]
    labels = ids.masked_fill(enc["attention_mask"] == 0, -100)
    return (ids[:96], labels[:96]), (ids[96:], labels[96:]), len(tokenizer)


def token_mean_losses(outputs, labels):
    """Per-snippet mean next-token cross-entropy over its real tokens, (B,)."""
    logits = outputs.logits[:, :-1]
    targets = labels[:, 1:]
    losses = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                         ignore_index=-100, reduction="none").view(targets.shape)
    return losses.sum(1) / (targets != -100).sum(1)


def gpt2_train(record: ik.unrolled.Record | None):
    """The tiny GPT-2's 24 AdamW steps, plain (``record`` None) or watched; returns the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    (ids, labels), _, vocab = GPT2_DATA
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=2, eos_token_id=3,
                                       tie_word_embeddings=False, attn_implementation="eager"))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 4))
    loader = DataLoader(TensorDataset(ids, labels), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    if record is None:
        loop(model, opt, loader, 24, scheduler=sched, clip=1.0, params=list(model.parameters()),
             loss=token_mean_losses)
    else:
        with record.watch(model, opt, loader, token_mean_losses) as run:
            loop(model, opt, loader, 24, scheduler=sched, clip=1.0, run=run, loss=token_mean_losses)
    return model


def gpt2_rows(repeats: int, before) -> list[dict]:
    """Plain, recorded and recorded + metagradient seconds of the tiny GPT-2 run (the metagradient today's and
    ``before``'s on the same record), fastest of ``repeats``."""
    global GPT2_DATA
    GPT2_DATA = gpt2_data()
    test = GPT2_DATA[1]
    times = {"GPT-2 plain": [], "GPT-2 recorded": [], "GPT-2 recorded + metagradient": [], "GPT-2 metagradient": []}
    earlier = {"GPT-2 recorded + metagradient": [], "GPT-2 metagradient": []}
    for _ in range(repeats):
        timed_round(times, earlier, gpt2_train, test, before, "GPT-2 ")
    return rows_of(times, earlier, "GPT-2 plain", {"GPT-2 recorded": 1.15, "GPT-2 metagradient": 3.0})


def rows_of(times: dict, earlier: dict, plain: str, targets: dict) -> list[dict]:
    """Table rows: each run's fastest seconds and ratio to the fastest ``plain``, beside the reverse pass before."""
    base = min(times[plain])
    return [{"run": k, "seconds (fastest)": min(v), "ratio to plain": min(v) / base,
             "ratio before": min(earlier[k]) / base if k in earlier else None, "target": targets.get(k),
             "repeats": len(v)} for k, v in times.items()]


def agree(before: list, today: list) -> bool:
    """Whether two metagradient passes' scores agree to float32 rounding."""
    return all(torch.allclose(a.values, b.values, rtol=1e-3, atol=1e-5 * float(a.values.abs().max()))
               for a, b in zip(before, today))


def timed_call(fn):
    """(seconds, result) of fn()."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def metagradients_before(commit: str = BEFORE):
    """``ik.unrolled.metagradients`` as of ``commit``: that commit's ``metagradient.py`` (the reverse pass the
    optimization rewrote) run against today's record, replay and optimizer modules, whose ``update`` it calls
    unchanged — the reverse pass before, on the same record in the same process."""
    import subprocess
    import sys
    import types

    source = subprocess.run(["git", "show", f"{commit}:influkit/methods/unrolled/metagradient.py"], check=True,
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    module = types.ModuleType("influkit.unrolled.metagradient_before")
    module.__package__ = "influkit.unrolled"
    sys.modules[module.__name__] = module  # its dataclasses look their module up there
    exec(compile(source, f"{commit}:influkit/methods/unrolled/metagradient.py", "exec"), module.__dict__)
    return module.metagradients


def breakdown(train_fn, test, label: str) -> list[dict]:
    """Where one metagradient's seconds go (its fastest of 4, each beside a plain run), each part as a ratio to the
    fastest plain run of those 4:
    the replayed gradient (forward + backward with ``create_graph``), the update forward, the update's closed-form
    pullback, the double backward through the gradient's graph, and the rest (batches, bookkeeping, replay check).
    Timed by wrapping those four functions for the measurement only."""
    from influkit.unrolled import metagradient as mg
    from influkit.unrolled import run as runs

    parts = {"replayed gradient (forward + create_graph backward)": (runs.StageRun, "gradient"),
             "update forward": (runs.StageRun, "update_vjp"), "update pullback (closed form)": (mg._Update, "pull"),
             "double backward (H v + example terms)": (mg._Graph, "pull")}
    spent = dict.fromkeys(parts, 0.0)
    originals = {name: getattr(owner, attr) for name, (owner, attr) in parts.items()}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - begin
        return wrapper

    record = ik.unrolled.Record()
    train_fn(record)
    best, plain_seconds = None, float("inf")
    try:
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, timed(name, originals[name]))
        for _ in range(4):
            plain_seconds = min(plain_seconds, seconds(lambda: train_fn(None)))
            for name in spent:
                spent[name] = 0.0
            total = seconds(lambda: ik.unrolled.metagradients(record, test))
            if best is None or total < best[0]:
                best = (total, dict(spent))
    finally:
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, originals[name])
    total, spent = best
    spent["rest (batches, bookkeeping, replay check)"] = total - sum(spent.values())
    return [{"run": label, "part": name, "seconds": value, "ratio to plain": value / plain_seconds}
            for name, value in spent.items()]


def profile(record, test) -> str:
    """cProfile of one metagradient (after a warm-up), the 25 largest internal times, to profile_metagradient.txt."""
    import cProfile
    import io
    import pstats

    ik.unrolled.metagradients(record, test)
    profiler = cProfile.Profile()
    profiler.enable()
    ik.unrolled.metagradients(record, test)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    (OUT / "profile_metagradient.txt").write_text(text.getvalue())
    return "profile_metagradient.txt"


def timed_round(times: dict, earlier: dict, run, test, before, prefix: str = "") -> "ik.unrolled.Record":
    """One interleaved round, back to back: the plain run (``run(None)``), the recorded run, and record + one exact
    metagradient by today's reverse pass (``times``) and by the reverse pass before (``earlier``), whose scores must
    agree. Returns the round's record."""
    times[f"{prefix}plain"].append(seconds(lambda: run(None)))
    times[f"{prefix}recorded"].append(seconds(lambda: run(ik.unrolled.Record())))
    record = ik.unrolled.Record()
    recording = seconds(lambda: run(record))
    reverse, results = timed_call(lambda: ik.unrolled.metagradients(record, test))
    times[f"{prefix}recorded + metagradient"].append(recording + reverse)
    times[f"{prefix}metagradient"].append(reverse)
    assert results[0].diagnostics["replay"]["max_error"] == 0.0
    reverse, old = timed_call(lambda: before(record, test))
    earlier[f"{prefix}recorded + metagradient"].append(recording + reverse)
    earlier[f"{prefix}metagradient"].append(reverse)
    assert agree(old, results)
    return record


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--q", type=int, default=10, help="test points of the q-measures comparison")
    parser.add_argument("--quick", action="store_true", help="2 repeats, q = 4")
    parser.add_argument("--profile", action="store_true", help="also write where one metagradient's time goes")
    args = parser.parse_args(argv)
    repeats, q = (2, 4) if args.quick else (args.repeats, args.q)
    torch.set_num_threads(1)
    data = task()
    test = data[2]
    before = metagradients_before()
    times = {"plain": [], "recorded": [], "recorded + metagradient": [], "metagradient": []}
    earlier = {"recorded + metagradient": [], "metagradient": []}
    for _ in range(repeats):  # interleaved: the machine's load moves within minutes
        record = timed_round(times, earlier, lambda record: train(data, record), test, before)
    points = (test[0][:q], test[1][:q])
    together, separate = f"{q} measures in one pass (per_test)", f"{q} measures in {q} separate passes"
    times |= {together: [], separate: []}
    earlier |= {together: [], separate: []}
    for _ in range(max(1, repeats // 2)):
        for fn, out in ((ik.unrolled.metagradients, times), (before, earlier)):
            out[together].append(seconds(lambda: fn(record, points, per_test=True)))
            out[separate].append(seconds(lambda: [fn(record, (points[0][j:j + 1], points[1][j:j + 1]))
                                                  for j in range(q)]))
    rows = rows_of(times, earlier, "plain", {"recorded": 1.15, "metagradient": 3.0})
    global TRAINER_DATA
    TRAINER_DATA = trainer_data()
    trainer_times = {"Trainer plain": [], "Trainer recorded": []}
    for _ in range(repeats):
        trainer_times["Trainer plain"].append(seconds(lambda: trainer_run(None)))
        trainer_times["Trainer recorded"].append(seconds(lambda: trainer_run(ik.unrolled.Record())))
    rows += rows_of(trainer_times, {}, "Trainer plain", {"Trainer recorded": 1.15})
    rows += gpt2_rows(repeats, before)
    table = pd.DataFrame(rows)
    parts = pd.DataFrame(breakdown(lambda r: train(data, r), test, "MLP") + breakdown(gpt2_train, GPT2_DATA[1], "GPT-2"))
    print(parts.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.profile:
        profiled = profile(record, test)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    OUT.mkdir(parents=True, exist_ok=True)
    table.to_csv(OUT / "cost.csv", index=False)
    parts.to_csv(OUT / "breakdown.csv", index=False)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    rows_at = range(len(table))
    ax.barh([i - 0.2 for i in rows_at], table["ratio before"], height=0.4, color="tab:gray",
            label=f"reverse pass before (commit {BEFORE})")
    ax.barh([i + 0.2 for i in rows_at], table["ratio to plain"], height=0.4, color="tab:blue", label="today")
    ax.legend(loc="lower right")
    ax.set_yticks(list(rows_at), table["run"])
    for target in (1.15, 3.0):
        ax.axvline(target, color="tab:red", lw=0.8, ls="--")
    ax.set_xlabel("seconds / the plain run (its own plain loop; Trainer rows: the plain Trainer run)")
    ax.invert_yaxis()
    left = {label: 0.0 for label in parts["run"].unique()}
    for (name, group), color in zip(parts.groupby("part", sort=False), plt.cm.tab10.colors):
        bx.barh(group["run"], group["ratio to plain"], left=[left[r] for r in group["run"]], color=color, label=name)
        for r, v in zip(group["run"], group["ratio to plain"]):
            left[r] += v
    bx.set_xlabel("one metagradient's parts / the plain run")
    bx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    bx.invert_yaxis()
    fig.tight_layout()
    fig.savefig(OUT / "cost.png", dpi=120)
    files = ["cost.csv", "breakdown.csv", "cost.png"]
    if args.profile:
        files.append(profiled)
    manifest(OUT, files, note="shared 2-core machine (helpers' jobs at once); one torch thread; timings "
             "interleaved in one process, fastest of the repeats; 'ratio before': the reverse pass of commit "
             f"{BEFORE} (its metagradient.py) on the same records, timed in the same process")
    return table


if __name__ == "__main__":
    main()
