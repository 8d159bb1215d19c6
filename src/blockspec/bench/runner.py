"""The benchmark runner: the same prompts and seeds through every configuration, interleaved, resumable.

For each dataset and temperature, prompt by prompt, every configuration runs in turn (A B C A B C ...), so
machine drift affects them alike; each configuration is warmed up once first, outside the records. Records
go to ``<out>/records.jsonl`` as they are made; a rerun skips what is there, and ``time_budget`` stops
scheduling new runs once spent.
"""

from __future__ import annotations

import logging
import platform
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import records as rec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    target: str = "qwen2.5-coder-1.5b"
    draft: str = "qwen2.5-coder-0.5b"
    dtype: str = "bfloat16"
    device: str = "cpu"
    datasets: tuple[str, ...] = ("gsm8k", "humaneval", "sharegpt")
    prompts_per_dataset: int = 2
    draft_lens: tuple[int, ...] = (4, 8)
    temperatures: tuple[float, ...] = (1.0,)
    configs: tuple[str, ...] = rec.CONFIGS
    max_new_tokens: int = 64
    seed: int = 0
    chat: bool = True
    time_budget: float | None = None  # seconds; None = run the whole plan
    precision: float | None = None  # stop once every paired analytic gain is known to +- this (checked per round)
    out: Path = Path("results/bench")


PRESETS = {
    # The bundled pair, 3 datasets, a few prompts each, K in {4, 8}, temperature 1: about 15 minutes here.
    "quick": BenchConfig(),
    # The paper's grid: every dataset, K in {2, 4, 6, 8}, greedy and sampled; resumable, in several parts.
    "paper": BenchConfig(
        datasets=("gsm8k", "translation", "humaneval", "sharegpt", "summarize", "lm1b"),
        prompts_per_dataset=20, draft_lens=(2, 4, 6, 8), temperatures=(1.0, 0.0), max_new_tokens=128,
        time_budget=3 * 3600.0, precision=0.01,
    ),
}


@dataclass(frozen=True)
class Run:
    """One planned generation: a prompt through one configuration."""

    dataset: str
    prompt_id: str
    ids: tuple[int, ...] = field(repr=False)
    config: str
    draft_len: int
    temperature: float
    seed: int

    @property
    def key(self) -> tuple:
        return (self.dataset, self.prompt_id, self.config, self.draft_len, self.temperature, 1)


def plan(config: BenchConfig, prompts: dict[str, list[tuple[str, list[int]]]]) -> list[Run]:
    """Every run, interleaved: round n takes prompt n of every dataset, at every temperature, through all
    configurations in turn; so a run cut short by its budget still covers every dataset and configuration."""
    runs = []
    for n in range(max(len(items) for items in prompts.values())):
        seed = config.seed + n  # the same seed for every configuration of this prompt
        for dataset, items in prompts.items():
            if n >= len(items):
                continue
            prompt_id, ids = items[n]
            for temperature in config.temperatures:
                for name in config.configs:
                    lens = config.draft_lens if name in ("token", "block") else (0,)
                    runs.extend(Run(dataset, prompt_id, tuple(ids), name, k, temperature, seed) for k in lens)
    return runs


MIN_PROMPTS = 5  # per dataset, before a bootstrap interval is trusted to stop a run


def gain_is_known(records_file: Path, precision: float) -> bool:
    """Whether every pooled paired analytic block-vs-token gain has a confidence half-width <= precision, with
    at least MIN_PROMPTS prompts of every dataset behind it."""
    from .report import build_report, summary

    records = list(rec.read(records_file))
    prompts = Counter(dataset for dataset, _ in {(r.dataset, r.prompt_id) for r in records if r.config == "block"})
    if not prompts or min(prompts.values()) < MIN_PROMPTS:
        return False
    rows = summary(build_report(records))["summary"]
    widths = [(r["analytic_gain"]["hi"] - r["analytic_gain"]["lo"]) / 2 for r in rows
              if r["analytic_gain"] and r["analytic_gain"]["lo"] is not None]
    return bool(widths) and len(widths) == len(rows) and max(widths) <= precision


def run(config: BenchConfig, *, progress: bool = True) -> Path:
    """Run (or resume) the plan of ``config``; returns the records file."""
    from ..chat import encode_prompt
    from ..models.hf import load_model
    from . import datasets

    records_file = config.out / "records.jsonl"
    done = {r.key for r in rec.read(records_file)} if records_file.exists() else set()
    target = load_model(config.target, dtype=config.dtype, device=config.device)
    draft = load_model(config.draft, dtype=config.dtype, device=config.device)
    prompts = {
        name: [(p.id, encode_prompt(target.tokenizer, p.text, chat=config.chat))
               for p in datasets.load(name, n=config.prompts_per_dataset, seed=config.seed)]
        for name in config.datasets
    }
    todo = [r for r in plan(config, prompts) if r.key not in done]
    log.info("%d runs planned, %d already recorded", len(todo) + len(done), len(done))
    if not todo:
        return records_file

    executor = Executor(target, draft, config)
    executor.warm_up({(r.config, r.draft_len, r.temperature) for r in todo})
    start = time.perf_counter()
    bar = _progress(len(todo), progress)
    for n, item in enumerate(todo):
        # Budget checked before each run; the first always goes, so every resumed call makes progress.
        if config.time_budget is not None and n and time.perf_counter() - start > config.time_budget:
            log.warning("time budget of %.0f s spent: %d runs left for a resumed run", config.time_budget,
                        len(todo) - n)
            break
        new_round = n and item.seed != todo[n - 1].seed
        if config.precision is not None and new_round and gain_is_known(records_file, config.precision):
            log.warning("block-vs-token gain known to +-%.3f: stopping with %d runs left", config.precision,
                        len(todo) - n)
            break
        rec.append(records_file, executor(item))
        bar.update(1)
    bar.close()
    return records_file


class Executor:
    """Runs one planned generation and turns it into a Record."""

    def __init__(self, target, draft, config: BenchConfig):
        from ..engine import SpeculativeDecoder

        self.target, self.draft, self.config = target, draft, config
        self.decoders = {"target-only": lambda k: SpeculativeDecoder(target, verifier="none")}
        for verifier in ("token", "block"):
            self.decoders[verifier] = lambda k, v=verifier: SpeculativeDecoder(target, draft, verifier=v, draft_len=k)
        self.meta = {
            "target": config.target, "draft": config.draft, "dtype": config.dtype, "device": config.device,
            "threads": torch.get_num_threads(), "machine": platform.platform(), "processor": platform.processor(),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": __import__("transformers").__version__},
        }

    def warm_up(self, variants) -> None:
        warm = Run("warm-up", "warm-up", tuple(self.target.tokenizer("Hello")["input_ids"]), "", 0, 1.0, 0)
        for name, draft_len, temperature in sorted(variants):
            self._generate(replace(warm, config=name, draft_len=draft_len, temperature=temperature), 8)

    def __call__(self, item: Run) -> rec.Record:
        result = self._generate(item, self.config.max_new_tokens)
        return rec.Record(
            dataset=item.dataset, prompt_id=item.prompt_id, config=item.config, draft_len=item.draft_len,
            temperature=item.temperature, batch_size=1, seed=item.seed, **result,
            meta={**self.meta, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        )

    def _generate(self, item: Run, max_new_tokens: int) -> dict:
        from ..sampling import SamplingParams

        sampling = SamplingParams(temperature=item.temperature)
        if item.config == "hf-assisted":
            return run_assisted(self.target, self.draft, list(item.ids), sampling, max_new_tokens, item.seed)
        decoder = self.decoders[item.config](item.draft_len)
        result = decoder.generate([list(item.ids)], max_new_tokens=max_new_tokens, sampling=sampling,
                                  seed=item.seed, expected=item.config in ("token", "block"))
        steps = result.stats
        return {
            "new_tokens": result.new_tokens, "wall_time": result.wall_time, "prefill_time": result.prefill_s,
            "accepted": [s.accepted[0] for s in steps], "draft_lens": [s.draft_len[0] for s in steps],
            "expected_token": [s.expected_token[0] for s in steps if s.expected_token is not None],
            "expected_block": [s.expected_block[0] for s in steps if s.expected_block is not None],
            "finish_reason": result.finish_reasons[0],
        }


def run_assisted(target, draft, prompt: list[int], sampling, max_new_tokens: int, seed: int) -> dict:
    """transformers' own assisted generation (its default assistant schedule) on the same models and sampling."""
    torch.manual_seed(seed)  # transformers samples from the global generator (top_k=0 disables its default 50)
    ids = torch.tensor([prompt], device=target.device)
    options = {"do_sample": False} if sampling.greedy else {
        "do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
        "top_p": sampling.top_p}
    start = time.perf_counter()
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft.model,
                                max_new_tokens=max_new_tokens, eos_token_id=list(target.eos_token_ids),
                                pad_token_id=target.eos_token_ids[0], **options)
    new = out[0, len(prompt):].tolist()
    return {"new_tokens": len(new), "wall_time": time.perf_counter() - start, "prefill_time": None,
            "finish_reason": "eos" if new and new[-1] in target.eos_token_ids else "length"}


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench runs", unit="run", disable=not enabled, file=sys.stderr)
