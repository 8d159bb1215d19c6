"""A draft whose vocabulary is cut to its most frequent tokens: a smaller output layer, the same exactness.

A draft's output layer scores every token of the vocabulary at every drafted position: for the bundled 0.5B draft,
151,936 rows that are 37 % of the bytes a drafted token reads on llama.cpp. ``cut_vocabulary`` writes a copy of a
GGUF whose vocabulary keeps the first ``keep`` ids and every special token, its embedding and output rows cut to
match; ``VocabularyCut`` runs that copy as a draft of the full vocabulary.

Why the first ids: a byte-level BPE vocabulary numbers its tokens in the order their merges were learnt, which is
the order of their frequency in the tokenizer's corpus, so the first ids are the common tokens (with the bundled
tokenizer, ids past 32,768 are 4-6 % of the tokens of the bench's code and chat prompts; past 65,536, 1-3 %).

Why decoding stays lossless: the cut draft's law is its own (zero on every dropped token), and verification sees
exactly that law, as it sees a quantized draft's. Only acceptance moves: the target's mass on dropped tokens is never
drafted. A dropped token in the context reaches the draft as its longest kept prefix (every token has one: the byte
tokens are kept), so the draft reads a close spelling of the text.

Whether it pays is measured, not assumed: for the bundled pair it does not (docs/results.md: code keeps identifiers
in rare tokens, which a cut draft can neither read nor propose), so nothing cuts a vocabulary unless asked.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import numpy as np
import torch

from ..defaults import NOTICE
from .cache import derived_gguf

log = logging.getLogger(__name__)

_SPECIAL_ID = ("bos", "eos", "eot", "eom", "unknown", "padding", "sep", "cls", "mask")  # tokenizer.ggml.<x>_token_id
_TOKEN_IDS = {f"tokenizer.ggml.{name}_token_id" for name in _SPECIAL_ID}
_VOCABULARY_KEYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
_CUT_TENSORS = ("token_embd.weight", "output.weight")  # one row per token


def kept_ids(token_types: np.ndarray, keep: int) -> np.ndarray:
    """The ids a cut to ``keep`` keeps, in their new order: the first ``keep``, then every special token past them
    (control and user-defined: the chat template's and the end-of-text tokens)."""
    import gguf

    if keep < 1:
        raise ValueError(f"a vocabulary cut keeps at least one token, got keep={keep}")
    special = np.isin(token_types, [gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED])
    later = np.flatnonzero(special[keep:]) + keep
    return np.concatenate([np.arange(min(keep, len(token_types))), later])


def reads_as(tokens: list[str], kept: np.ndarray) -> np.ndarray:
    """For every id of the full vocabulary, the new id of the token the cut draft reads in its place: itself where
    kept, else its longest kept prefix (the byte-level symbols spell bytes, so a prefix of the symbols is a prefix
    of the text), else the first kept token (never with a byte-level vocabulary whose byte tokens are kept)."""
    new_id = {tokens[old]: new for new, old in enumerate(kept.tolist())}
    reads = np.empty(len(tokens), dtype=np.int64)
    for old, text in enumerate(tokens):
        for end in range(len(text), 0, -1):
            found = new_id.get(text[:end])
            if found is not None:
                reads[old] = found
                break
        else:
            reads[old] = 0
    return reads


def cut_vocabulary(path: Path, keep: int) -> Path:
    """``path`` with its vocabulary cut to ``keep`` tokens (``kept_ids``), written once into the model cache (keyed
    by the file's path, size and mtime), with its ``ids_file`` beside it. Quantized rows are copied as they are: no
    weight changes."""
    import gguf

    from ..files import TEMPORARY_SUFFIX

    out = derived_gguf(path, f"vocab{keep}")
    if out.is_file() and ids_file(out).is_file():
        return out
    log.log(NOTICE, "cutting the vocabulary of %s to %d tokens (once: kept as %s)", path.name, keep, out)
    reader = gguf.GGUFReader(path)
    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
    types = np.asarray(reader.fields["tokenizer.ggml.token_type"].contents())
    kept = kept_ids(types, keep)
    if len(kept) >= len(tokens):
        raise ValueError(f"{path.name} has {len(tokens)} tokens: a cut to {keep} keeps them all")
    reads = reads_as(tokens, kept)
    new_id = dict(zip(kept.tolist(), range(len(kept)), strict=True))

    out.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)  # concurrent runs each write their own partial files
    partial_ids = ids_file(out).with_name(f"{ids_file(out).name}.{token}{TEMPORARY_SUFFIX}")
    partial = out.with_name(f"{out.name}.{token}{TEMPORARY_SUFFIX}")
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(partial, arch)
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # the writer's own
            value = field.contents()
            if key in _VOCABULARY_KEYS:
                value = [value[i] for i in kept.tolist()]
            elif key in _TOKEN_IDS:
                if int(value) not in new_id:
                    continue  # a special id on a dropped token: the cut has none
                value = new_id[int(value)]
            elif key == "general.name":
                value = f"{value} (vocabulary cut to {keep})"
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
        for tensor in reader.tensors:
            data = tensor.data
            if tensor.name in _CUT_TENSORS:
                data = np.ascontiguousarray(data[kept])
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with partial_ids.open("wb") as file:
            np.savez(file, kept=kept, reads=reads)
        os.replace(partial_ids, ids_file(out))
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
        partial_ids.unlink(missing_ok=True)
    return out


def ids_file(cut: Path) -> Path:
    """Beside a cut GGUF: its kept ids in their new order, and for every id of the full vocabulary the new id the
    draft reads it as (``reads_as``); a NumPy file, read in milliseconds where the GGUF's metadata takes seconds."""
    return cut.with_suffix(".ids.npz")


def read_cut(cut: Path) -> tuple[np.ndarray, np.ndarray]:
    """(kept, reads) of a GGUF ``cut_vocabulary`` wrote."""
    with np.load(ids_file(cut)) as ids:
        return ids["kept"], ids["reads"]


class VocabularyCut:
    """A ``TreeLanguageModel`` of the full vocabulary over ``model``, which runs a cut GGUF (``cut_vocabulary``):
    tokens in are read as ``reads[token]``, and the logits of the kept ids are scattered into rows of ``vocab_size``
    whose other entries are -inf (probability zero, whatever the temperature; never argmax)."""

    def __init__(self, model, kept: np.ndarray, reads: np.ndarray, *, eos_token_ids: tuple[int, ...], tokenizer=None):
        self.model = model
        self.kept = torch.as_tensor(kept, dtype=torch.long)
        self.reads = torch.as_tensor(reads, dtype=torch.long)
        self.vocab_size = len(reads)
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_length = model.max_length
        self.device = model.device
        self.name = model.name
        self.dtype = model.dtype

    def __repr__(self) -> str:
        return f"VocabularyCut({self.model!r}, {len(self.kept)} of {self.vocab_size} tokens)"

    @property
    def lengths(self) -> torch.Tensor:
        return self.model.lengths

    def prefill(self, sequences: list[list[int]]) -> None:
        self.model.prefill([self.reads[torch.as_tensor(s, dtype=torch.long)].tolist() for s in sequences])

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        return self._full(self.model.forward(self.reads[tokens], valid, last=last))

    def rollback(self, lengths: torch.Tensor) -> None:
        self.model.rollback(lengths)

    def select(self, rows: torch.Tensor) -> None:
        self.model.select(rows)

    # Trees, scored by the model it wraps (a LlamaCppModel): the nodes read and their logits scattered as ``forward``'s

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self._full(self.model.forward_tree(self.reads[tokens], parents, valid))

    def commit(self, path: torch.Tensor) -> None:
        self.model.commit(path)

    def _full(self, cut: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab_size] from the cut model's [..., kept]: -inf at every id the cut left out."""
        logits = cut.new_full((*cut.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., self.kept] = cut
        return logits
