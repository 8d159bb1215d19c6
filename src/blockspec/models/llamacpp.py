"""LlamaCppModel: the LanguageModel interface over llama.cpp's CPU kernels, on a GGUF file as it is.

No dequantized copy is made: llama.cpp runs the file's own quantized weights (Q4_K_M for the bundled target). Each
row of a batch is one llama.cpp sequence in one unified KV cache; a forward is one ``llama_decode`` of every valid
slot of every row, each at its row's next position, with logits for all of them; a rollback removes the row's
cells past its new length (``llama_memory_seq_rm``); ``select`` drops the sequences of rows no longer kept. The
cache grows when a batch outgrows it: a new context, and every row's tokens decoded again.

Text goes through the same transformers tokenizer as the HF path (``load_llamacpp``), so both backends see identical
token ids. llama.cpp comes from the pinned ``llama-cpp-python`` (its C API through ctypes; its Python classes are
not used).
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from ..defaults import LLAMACPP_QUANTS
from .cache import derived_gguf
from .vocab_cut import VocabularyCut, cut_vocabulary, read_cut

log = logging.getLogger(__name__)

INSTALL_HINT = "bash scripts/setup.sh (it builds the pinned llama-cpp-python for this CPU)"
MIN_CELLS = 4096  # KV cells a context starts with: 115 MB for the bundled 1.5B target at f16
MAX_ROWS = 256  # llama.cpp's limit on sequences in one context (LLAMA_MAX_SEQ)
BATCH_TOKENS = 512  # tokens per llama_decode call: a longer prefill or forward is split

_lib: Any = None
_silence: Any = None  # the log callback must outlive every call into llama.cpp


def library():
    """llama-cpp-python's ctypes bindings, with llama.cpp's backend initialised and its log quiet (its warnings go to
    this module's logger as info, its errors as errors). Raises ImportError naming the set-up step when missing."""
    global _lib, _silence
    if _lib is None:
        try:
            import llama_cpp.llama_cpp as lib
        except ImportError as error:
            raise ImportError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}") from error

        def forward_log(level: int, text: bytes, _user: Any) -> None:
            # GGML_LOG_LEVEL_WARN (3) is mostly notes on the file as it loads: info here; ERROR (4) stays an error
            if level in (3, 4):
                log.log(logging.INFO if level == 3 else logging.ERROR, "%s", text.decode(errors="replace").rstrip())

        _silence = lib.llama_log_callback(forward_log)
        lib.llama_log_set(_silence, ctypes.c_void_p())
        lib.llama_backend_init()
        _lib = lib
    return _lib


class LlamaCppModel:
    """A GGUF file on llama.cpp, as a ``LanguageModel``. ``tokenizer`` (a transformers tokenizer of the same
    vocabulary, or None) encodes and decodes text; ``eos_token_ids`` default to the GGUF's end-of-generation tokens;
    ``threads`` default to torch's thread count, the setting the HF path follows. Logits are float32 on the CPU."""

    def __init__(
        self,
        path: str | os.PathLike,
        tokenizer: Any = None,
        *,
        name: str | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
        threads: int | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ):
        lib = library()
        self.path = Path(path)
        self.name = name or self.path.name
        self.tokenizer = tokenizer
        self.threads = threads or torch.get_num_threads()
        self.on_prefill = on_prefill
        self.device = torch.device("cpu")
        self.dtype = "gguf"  # the file's own quantization: how latency profiles keyed by dtype tell it from HF's
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path} (see the log above for its reason)")
        vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self.max_length = int(lib.llama_model_n_ctx_train(self._model)) or None
        if eos_token_ids is None:
            ends = (lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab))
            eos_token_ids = tuple(dict.fromkeys(int(t) for t in ends if t >= 0))
        self.eos_token_ids = eos_token_ids
        self._context: Any = None
        self._cells = self._rows_max = 0
        self._sequences: list[int] = []  # row -> llama.cpp sequence id
        self._tokens: list[list[int]] = []  # row -> its tokens in the cache, to decode again when the cache grows
        self._batch = _Batch(BATCH_TOKENS)

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.name}, {self.threads} threads)"

    def __del__(self) -> None:
        lib = _lib
        if lib is None:
            return
        if getattr(self, "_context", None):
            lib.llama_free(self._context)
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(t) for t in self._tokens], dtype=torch.long)

    # --- the LanguageModel interface ----------------------------------------------------------------------

    def prefill(self, sequences: list[list[int]]) -> None:
        longest = max((len(s) for s in sequences), default=0)
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(f"{self.name}: a prompt of {longest} tokens exceeds the context of {self.max_length}")
        if len(sequences) > MAX_ROWS:
            raise ValueError(f"{self.name}: llama.cpp decodes at most {MAX_ROWS} rows at once, got {len(sequences)}")
        self._tokens = [list(map(int, s)) for s in sequences]
        self._sequences = list(range(len(sequences)))
        self._reserve(sum(len(s) for s in sequences), fresh=True)
        self._decode_all()

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        rows, width = tokens.shape
        lengths = self.lengths
        positions = (lengths[:, None] + valid.long().cumsum(1) - 1)[valid]  # [n], row-major as the valid slots
        if self.max_length is not None and bool((positions >= self.max_length).any()):
            raise ValueError(f"{self.name}: the sequence outgrew the model's context of {self.max_length} tokens")
        new = tokens[valid].tolist()
        row_of = torch.arange(rows)[:, None].expand(rows, width)[valid].tolist()
        self._reserve(len(new))
        logits = torch.zeros(rows, width, self.vocab_size)
        sequences = [self._sequences[b] for b in row_of]
        logits[valid] = self._decode(new, positions.tolist(), sequences, outputs=True)
        for b, token in zip(row_of, new, strict=True):
            self._tokens[b].append(token)
        return logits

    def rollback(self, lengths: torch.Tensor) -> None:
        lib = library()
        memory = lib.llama_get_memory(self._context)
        for b, keep in enumerate(lengths.tolist()):
            if keep < len(self._tokens[b]):
                lib.llama_memory_seq_rm(memory, self._sequences[b], keep, -1)
                del self._tokens[b][keep:]

    def select(self, rows: torch.Tensor) -> None:
        kept = rows.tolist()
        if len(set(kept)) != len(kept):
            raise ValueError(f"{self.name}: select keeps each row at most once, got {kept}")
        lib = library()
        memory = lib.llama_get_memory(self._context)
        for b in set(range(len(self._tokens))) - set(kept):
            lib.llama_memory_seq_rm(memory, self._sequences[b], -1, -1)
        self._sequences = [self._sequences[b] for b in kept]
        self._tokens = [self._tokens[b] for b in kept]

    # --- internals ------------------------------------------------------------------------------------------

    def _reserve(self, new_tokens: int, *, fresh: bool = False) -> None:
        """A context with room for every row's tokens plus ``new_tokens`` more and for every sequence id in use; a
        context outgrown mid-generation is replaced and every row's tokens decoded again (``fresh``: the rows are
        new, nothing to keep)."""
        lib = library()
        cells = sum(len(t) for t in self._tokens) + (0 if fresh else new_tokens)
        ids = max(self._sequences, default=-1) + 1
        if self._context is not None and cells <= self._cells and ids <= self._rows_max:
            if fresh:
                lib.llama_memory_clear(lib.llama_get_memory(self._context), True)
            return
        if self._context is not None:
            lib.llama_free(self._context)
            self._context = None
        self._cells = max(MIN_CELLS, 2 * cells)
        self._rows_max = max(ids, self._rows_max, 1)
        params = lib.llama_context_default_params()
        params.n_ctx = self._cells
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = self._rows_max
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        self._context = lib.llama_init_from_model(self._model, params)
        if not self._context:
            raise RuntimeError(f"{self.name}: llama.cpp could not create a context of {self._cells} cells")
        if not fresh:
            log.info(
                "%s: KV cache grown to %d cells; decoding its %d rows again", self.name, self._cells, len(self._tokens)
            )
            self._decode_all()

    def _decode_all(self) -> None:
        """Decode every row's tokens into the (empty) cache, keeping no logits: the prefill."""
        tokens = [token for row in self._tokens for token in row]
        positions = [p for row in self._tokens for p in range(len(row))]
        sequences = [s for row, s in zip(self._tokens, self._sequences, strict=True) for _ in row]
        for start in range(0, len(tokens), BATCH_TOKENS):
            end = start + BATCH_TOKENS
            self._decode(tokens[start:end], positions[start:end], sequences[start:end], outputs=False)
            if self.on_prefill is not None:
                self.on_prefill(min(end, len(tokens)), len(tokens))

    def _decode(self, tokens: list[int], positions: list[int], sequences: list[int], *, outputs: bool) -> torch.Tensor:
        """``llama_decode`` of ``tokens`` at ``positions`` in ``sequences`` (split in calls of at most
        BATCH_TOKENS); their logits [n, vocab_size] if ``outputs``, else an empty tensor."""
        lib = library()
        parts = []
        for start in range(0, len(tokens), BATCH_TOKENS):
            end = min(start + BATCH_TOKENS, len(tokens))
            batch = self._batch.fill(tokens[start:end], positions[start:end], sequences[start:end], outputs)
            code = lib.llama_decode(self._context, batch)
            if code != 0:
                raise RuntimeError(f"{self.name}: llama_decode failed with code {code} on {end - start} tokens")
            if outputs:
                pointer = lib.llama_get_logits(self._context)
                parts.append(torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(end - start, self.vocab_size))))
                parts[-1] = parts[-1].clone()  # the buffer is llama.cpp's, overwritten by the next decode
        return torch.cat(parts) if parts else torch.empty(0, self.vocab_size)


class _Batch:
    """A ``llama_batch`` over numpy arrays this object owns: filled by slices, no per-token ctypes call."""

    def __init__(self, capacity: int):
        lib = library()
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        seq_type = ctypes.POINTER(lib.llama_seq_id)
        address, step = self.seq.ctypes.data, self.seq.itemsize
        self.seq_pointers = (seq_type * capacity)(*(ctypes.cast(address + i * step, seq_type) for i in range(capacity)))
        self.batch = lib.llama_batch()
        self.batch.token = self.token.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        self.batch.embd = None
        self.batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = self.seq_pointers
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: list[int], positions: list[int], sequences: list[int], outputs: bool):
        n = len(tokens)
        self.token[:n], self.pos[:n], self.seq[:n], self.logits[:n] = tokens, positions, sequences, int(outputs)
        self.batch.n_tokens = n
        return self.batch


# llama.cpp's own weight types a GGUF can be requantized to (llama_ftype): every tensor, embeddings and output layer
# included, since the output layer's 151,936 rows are a third of the bundled draft's bytes
QUANTS = dict(zip(LLAMACPP_QUANTS, (2,), strict=True))


def requantize(path: Path, quant: str) -> Path:
    """``path`` requantized to ``quant`` by llama.cpp (``llama_model_quantize``), once, into the model cache (keyed by
    the file's path, size and mtime): a cheaper draft.
    Its law is its own, and verification sees exactly that law, so decoding stays lossless; only acceptance moves."""
    from ..files import TEMPORARY_SUFFIX

    if quant not in QUANTS:
        raise ValueError(f"llama.cpp quantization must be one of {tuple(QUANTS)}, got {quant!r}")
    out = derived_gguf(path, quant)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lib = library()
    params = lib.llama_model_quantize_default_params()
    params.ftype = params.output_tensor_type = params.token_embedding_type = QUANTS[quant]
    params.allow_requantize, params.nthread = True, torch.get_num_threads()
    partial = out.with_name(f"{out.name}.{secrets.token_hex(4)}{TEMPORARY_SUFFIX}")  # concurrent runs each write own
    log.info("requantizing %s to %s (once)", path.name, quant)
    try:
        if lib.llama_model_quantize(str(path).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not requantize {path} to {quant}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


@overload
def load_llamacpp(
    name_or_path: str,
    *,
    quant: str | None = ...,
    vocabulary: None = ...,
    progress: bool = ...,
    threads: int | None = ...,
) -> LlamaCppModel: ...
@overload
def load_llamacpp(
    name_or_path: str,
    *,
    quant: str | None = ...,
    vocabulary: int | None = ...,
    progress: bool = ...,
    threads: int | None = ...,
) -> LlamaCppModel | VocabularyCut: ...
def load_llamacpp(
    name_or_path: str,
    *,
    quant: str | None = None,
    vocabulary: int | None = None,
    progress: bool = True,
    threads: int | None = None,
) -> LlamaCppModel | VocabularyCut:
    """A bundled preset or a GGUF file on llama.cpp, with the tokenizer and end tokens the HF path gives it (the
    preset's tokenizer and EOS list; a GGUF file's tokenizer read by transformers), so both backends agree on
    every token id. ``quant`` (one of QUANTS) runs a requantized copy (``requantize``); ``vocabulary`` a copy whose
    vocabulary is cut to that many tokens and their special tokens, as a model of the full vocabulary (a cheaper
    draft: ``vocab_cut``)."""
    from .convert import load_preset_tokenizer, materialize
    from .presets import PRESETS

    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        path = materialize(preset, progress=progress)
        tokenizer = load_preset_tokenizer(preset, progress=progress)
        eos = preset.eos_token_ids
    elif name_or_path.endswith(".gguf"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"no GGUF file at {name_or_path}")
        from transformers import AutoTokenizer

        path = Path(name_or_path).resolve()
        tokenizer, eos = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False), None
    else:
        raise ValueError(
            f"the llama.cpp backend runs GGUF files: {name_or_path!r} is neither a preset nor a .gguf file "
            "(use --backend hf for a transformers folder or hub id)"
        )
    if quant is not None:
        path = requantize(Path(path), quant)
    label = ", ".join(["llama.cpp", *([quant] if quant else []), *([f"{vocabulary} tokens"] if vocabulary else [])])
    if vocabulary is None:
        return LlamaCppModel(path, tokenizer, name=f"{name_or_path} ({label})", eos_token_ids=eos, threads=threads)
    cut = cut_vocabulary(Path(path), vocabulary)
    kept, reads = read_cut(cut)
    model = LlamaCppModel(cut, name=f"{name_or_path} ({label})", threads=threads)
    eos = eos or tuple(int(kept[t]) for t in model.eos_token_ids)  # the GGUF's own, in the cut's ids
    return VocabularyCut(model, kept, reads, eos_token_ids=eos, tokenizer=tokenizer)
