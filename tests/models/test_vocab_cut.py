"""A draft whose vocabulary is cut (``blockspec.models.vocab_cut``): the cut GGUF keeps the right rows, the adapter
maps tokens in and logits out, and the engine's output stays the target's (greedy equality here; the joint law at
temperature 1 through a cut draft: tests/engine/test_llamacpp.py).

The tiny models' tokenizer (``kits.tiny.tiny_tokenizer``) has single-letter tokens and no merges: no dropped token has
a kept prefix, so dropped tokens read as the first token there; the prefix rule is tested on a vocabulary of its own.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kits.tiny import VOCAB, perturbed, tiny_model
from kits.tinygguf import save_gguf

from blockspec import SamplingParams, SpeculativeDecoder
from blockspec.models.llamacpp import LlamaCppModel
from blockspec.models.vocab_cut import VocabularyCut, cut_vocabulary, kept_ids, read_cut, reads_as

pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.usefixtures("one_thread", "probes_in_a_temporary_cache")

EOS = VOCAB - 1  # the tiny tokenizer's one control token
KEEP = 40
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 44], [10, 11, 12, 13]]  # 44 is dropped by the cut


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("gguf_cut")
    target = tiny_model(sharpness=5.0)
    return save_gguf(target, folder / "target.gguf"), save_gguf(
        perturbed(target, scale=0.3, seed=1), folder / "draft.gguf"
    )


def full_model(path: str) -> LlamaCppModel:
    return LlamaCppModel(path, None, eos_token_ids=(EOS,), threads=1)


def cut_model(path: str, keep: int = KEEP) -> VocabularyCut:
    cut = cut_vocabulary(Path(path), keep)
    kept, reads = read_cut(cut)
    return VocabularyCut(LlamaCppModel(cut, None, threads=1), kept, reads, eos_token_ids=(EOS,))


def test_the_cut_keeps_the_first_ids_and_the_special_tokens():
    types = np.full(10, gguf.TokenType.NORMAL)
    types[[7, 9]] = gguf.TokenType.CONTROL
    types[8] = gguf.TokenType.UNUSED  # a padding row of the embedding: dropped
    assert kept_ids(types, 4).tolist() == [0, 1, 2, 3, 7, 9]
    with pytest.raises(ValueError, match="at least one"):
        kept_ids(types, 0)


def test_a_dropped_token_reads_as_its_longest_kept_prefix():
    tokens = ["a", "b", "ab", "abc", "\u0120f", "\u0120fo", "\u0120foo", "c", "ba", "zz"]
    kept = np.array([0, 1, 2, 4, 5])  # "abc", "\u0120foo", "c", "ba", "zz" are dropped
    reads = reads_as(tokens, kept)
    new = {old: i for i, old in enumerate(kept.tolist())}
    assert reads[[0, 1, 2, 4, 5]].tolist() == [0, 1, 2, 3, 4]  # a kept token reads as itself
    assert reads[3] == new[2]  # "abc" as "ab", not "a"
    assert reads[6] == new[5]  # "\u0120foo" as "\u0120fo"
    assert reads[8] == new[1]  # "ba" as "b"
    assert reads[7] == reads[9] == 0  # no kept prefix: the first token


def test_the_cut_file_holds_the_kept_rows_and_tokens(paths):
    source = gguf.GGUFReader(paths[1])
    cut = gguf.GGUFReader(cut_vocabulary(Path(paths[1]), KEEP))
    kept, _ = read_cut(cut_vocabulary(Path(paths[1]), KEEP))
    assert kept.tolist() == [*range(KEEP), EOS]
    tokens = [str(t) for t in source.fields["tokenizer.ggml.tokens"].contents()]
    assert [str(t) for t in cut.fields["tokenizer.ggml.tokens"].contents()] == [tokens[i] for i in kept]
    assert int(cut.fields["tokenizer.ggml.eos_token_id"].contents()) == KEEP  # EOS renumbered to its new id
    for name in ("token_embd.weight", "output.weight"):
        rows = {t.name: t.data for t in source.tensors}.get(name)
        if rows is not None:  # a model with tied embeddings has no output.weight
            assert np.array_equal({t.name: t.data for t in cut.tensors}[name], rows[kept]), name


def test_the_cut_scores_the_kept_tokens_as_the_full_model_does(paths):
    """On a context of kept tokens the cut model's logits of the kept ids are the full model's (the same rows of
    the same weights; llama.cpp's matmul over fewer rows may reassociate: 1e-5), its other logits -inf. A scatter
    off by one id (a plausible mapping bug) must fail the same comparison."""
    full, cut = full_model(paths[1]), cut_model(paths[1])
    rows = [[1, 2, 3, 4], [5, 6]]
    for model in (full, cut):
        model.prefill(rows)
    tokens, valid = torch.tensor([[7, 8], [9, 0]]), torch.tensor([[True, True], [True, False]])
    expected, got = full.forward(tokens, valid)[valid], cut.forward(tokens, valid)[valid]
    kept = cut.kept
    assert got.shape == expected.shape
    assert float((got[:, kept] - expected[:, kept]).abs().max()) < 1e-5
    dropped = torch.ones(VOCAB, dtype=torch.bool)
    dropped[kept] = False
    assert bool(torch.isneginf(got[:, dropped]).all())
    shifted = got[:, kept.roll(1)]
    assert float((shifted - expected[:, kept]).abs().max()) > 1e-2


def test_a_dropped_token_in_the_context_reaches_the_cut_model_as_its_reading(paths):
    cut = cut_model(paths[1])
    reference = LlamaCppModel(cut_vocabulary(Path(paths[1]), KEEP), None, threads=1)
    cut.prefill([[1, 44, 2]])
    reference.prefill([[1, int(cut.reads[44]), 2]])
    one = torch.ones(1, 1, dtype=torch.bool)
    got, expected = (
        cut.forward(torch.tensor([[45]]), one)[0, 0, cut.kept],
        reference.forward(torch.tensor([[int(cut.reads[45])]]), one)[0, 0],
    )
    assert torch.equal(got, expected)
    assert cut.lengths.tolist() == [4]


def test_rollback_and_select_reach_the_cut_model(paths):
    cut = cut_model(paths[1])
    cut.prefill([[1, 2, 3], [4, 5]])
    every = torch.ones(2, 2, dtype=torch.bool)
    first = cut.forward(torch.tensor([[6, 7], [8, 9]]), every)
    cut.rollback(torch.tensor([3, 2]))
    assert torch.equal(cut.forward(torch.tensor([[6, 7], [8, 9]]), every), first)
    cut.select(torch.tensor([1]))
    assert cut.lengths.tolist() == [4]


@pytest.mark.parametrize("rule", ["token", "block"])
def test_speculative_greedy_with_a_cut_draft_equals_the_target_alone(paths, rule):
    target_path, draft_path = paths
    greedy = SamplingParams(temperature=0.0)
    expected = SpeculativeDecoder(full_model(target_path)).generate(
        PROMPTS, max_new_tokens=30, sampling=greedy, stop_on_eos=False
    )
    decoder = SpeculativeDecoder(full_model(target_path), cut_model(draft_path), rule=rule, max_draft=3)
    result = decoder.generate(PROMPTS, max_new_tokens=30, sampling=greedy, stop_on_eos=False)
    assert result.sequences == expected.sequences
    assert 1.2 < result.block_efficiency < 4, result.block_efficiency  # drafts both accepted and rejected


def test_a_cut_that_keeps_everything_is_refused(paths):
    with pytest.raises(ValueError, match="keeps them all"):
        cut_vocabulary(Path(paths[1]), VOCAB)
