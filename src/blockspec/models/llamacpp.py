"""LlamaCppModel: the LanguageModel interface over llama.cpp's CPU kernels, on a GGUF file as it is.

No dequantized copy is made: llama.cpp runs the file's own quantized weights (Q4_K_M for the bundled target). Each
row of a batch is one llama.cpp sequence in one unified KV cache; a forward is one ``llama_decode`` of every valid
slot of every row, each at its row's next position, with logits for all of them; a rollback removes the row's
cells past its new length (``llama_memory_seq_rm``); ``select`` drops the sequences of rows no longer kept. The
cache grows when a batch outgrows it: a new context, and every row's tokens decoded again.

LlamaCppModel is a ``TreeLanguageModel`` too: ``forward_tree`` scores a drafted tree in one ``llama_decode``, and
``commit`` keeps one path of it. llama.cpp has no ancestor mask, but its own mask is close to one: a token attends to
the cells that hold its (first) sequence id at a position up to its own, and a cell may hold several sequence ids.
So each *leaf* of a row's tree owns a sequence that holds the row's cached tokens and the path root..leaf, at
consecutive positions: a node is one cell, in the sequences of every leaf below it, and sees exactly its row, its
ancestors and itself (its descendants sit at later positions, other branches in other sequences). A leaf's sequence
is first copied from the path of its nearest cached ancestor (``llama_memory_seq_cp`` over positions, which in a
unified cache only adds the id to those cells); the row's own sequence goes to the row's first leaf, and a waiting
leaf that gains children in a later ``forward_tree`` hands its sequence to its first new leaf, so a tree uses one
sequence id per leaf. ``commit`` gives the kept path's cells back to the row's sequence and removes every other
sequence, which frees every rejected node's cell. llama.cpp takes at most MAX_ROWS sequence ids in one context: the
rows and their trees' leaves together must fit in them.

Text goes through the same transformers tokenizer as the HF path (``load_llamacpp``), so both backends see identical
token ids. llama.cpp comes from the pinned ``llama-cpp-python`` (its C API through ctypes; its Python classes are
not used).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from ..defaults import LLAMACPP_DTYPE, LLAMACPP_QUANTS, NOTICE
from .base import check_tree, committed_path
from .cache import derived_gguf
from .vocab_cut import VocabularyCut, cut_vocabulary, read_cut

log = logging.getLogger(__name__)

INSTALL_HINT = "bash scripts/setup.sh (it builds the pinned llama-cpp-python for this CPU)"
MIN_CELLS = 4096  # KV cells a context starts with: 115 MB for the bundled 1.5B target at f16
MAX_ROWS = 256  # llama.cpp's limit on sequences in one context (LLAMA_MAX_SEQ): on rows, and on rows and tree leaves
BATCH_TOKENS = 512  # tokens per llama_decode call: a longer prefill or forward is split
# llama.cpp's defaults, kept here, round attention to f16: an f16 KV cache, and flash attention (on, on a CPU), which
# rounds its operands to f16 even over an f32 cache. True keeps attention in f32 (an f32 cache, no flash attention):
# a logit then moves with the order of float sums only (~1e-7), not by an f16 rounding that flips (~1e-4), as the
# tests want to compare decodes of different shapes tightly
F32_ATTENTION = False

# The instruction sets scripts/llamacpp_flags.sh switches on where the CPU has them (GGML_<set> in CMake, "<set> = 1"
# in llama.cpp's system info)
BUILD_SETS = ("AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16")

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


def build_info() -> str:
    """The instruction sets the installed llama.cpp was built with (its system info): they decide its kernels, so
    its figures. ImportError naming the set-up step where llama-cpp-python is missing."""
    return library().llama_print_system_info().decode().strip()


def build_mismatches(cmake_args: str, system_info: str) -> list[str]:
    """Where a llama.cpp build (``system_info``: its ``llama_print_system_info``) and the CMake arguments it was to be
    built with disagree on BUILD_SETS: "AVX512: asked for, not built" or "AVX512_BF16: built, not asked for". pip
    reuses a wheel it compiled before, even one compiled on a machine of another kind (a shared cache): a build
    without the CPU's instruction sets runs slowly, one with sets the CPU lacks crashes (scripts/setup.sh checks)."""
    asked = {name for name in BUILD_SETS if f"-DGGML_{name}=ON" in cmake_args.split()}
    built = {name for name in BUILD_SETS if re.search(rf"\b{name} = 1\b", system_info)}
    return [f"{name}: asked for, not built" for name in sorted(asked - built)] + [
        f"{name}: built, not asked for" for name in sorted(built - asked)
    ]


class LlamaCppModel:
    """A GGUF file on llama.cpp, as a ``TreeLanguageModel``. ``tokenizer`` (a transformers tokenizer of the same
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
        # the file's own quantization: how latency profiles keyed by dtype tell it from HF's
        self.dtype = LLAMACPP_DTYPE
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
        self._tree: _Tree | None = None  # the nodes of the forward_tree calls since the last commit
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
        self._tree = None
        self._tokens = [list(map(int, s)) for s in sequences]
        self._sequences = list(range(len(sequences)))
        self._reserve(sum(len(s) for s in sequences), fresh=True)
        self._decode_all()

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        self._no_tree_pending("forward")
        # The valid slots row-major, in plain Python: at one token a step, torch's per-call cost on tiny tensors
        # would be a measurable share of the step
        new, positions, row_of, outputs = [], [], [], []
        final = tokens.shape[1] - 1
        for b, (row, kept) in enumerate(zip(tokens.tolist(), valid.tolist(), strict=True)):
            at = len(self._tokens[b])
            for column, (token, here) in enumerate(zip(row, kept, strict=True)):
                if here:
                    new.append(token)
                    positions.append(at)
                    row_of.append(b)
                    outputs.append(not last or column == final)
                    at += 1
        if self.max_length is not None and max(positions, default=-1) >= self.max_length:
            raise ValueError(f"{self.name}: the sequence outgrew the model's context of {self.max_length} tokens")
        self._reserve(len(new))
        sequences = np.array([self._sequences[b] for b in row_of], dtype=np.int32)[:, None]  # [n, 1]
        scored = self._decode(new, positions, sequences, outputs=np.array(outputs, dtype=bool))
        logits = self._placed(scored, valid[:, -1:] if last else valid)
        for b, token in zip(row_of, new, strict=True):
            self._tokens[b].append(token)
        return logits

    def rollback(self, lengths: torch.Tensor) -> None:
        self._no_tree_pending("rollback")
        lib = library()
        memory = lib.llama_get_memory(self._context)
        for b, keep in enumerate(lengths.tolist()):
            if keep < len(self._tokens[b]):
                lib.llama_memory_seq_rm(memory, self._sequences[b], keep, -1)
                del self._tokens[b][keep:]

    def select(self, rows: torch.Tensor) -> None:
        self._no_tree_pending("select")
        kept = rows.tolist()
        if len(set(kept)) != len(kept):
            raise ValueError(f"{self.name}: select keeps each row at most once, got {kept}")
        lib = library()
        memory = lib.llama_get_memory(self._context)
        for b in set(range(len(self._tokens))) - set(kept):
            lib.llama_memory_seq_rm(memory, self._sequences[b], -1, -1)
        self._sequences = [self._sequences[b] for b in kept]
        self._tokens = [self._tokens[b] for b in kept]

    # --- the TreeLanguageModel interface --------------------------------------------------------------------

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        tokens, parents, valid = (t.cpu() if isinstance(t, torch.Tensor) else t for t in (tokens, parents, valid))
        tree = self._tree  # the nodes waiting for a commit, which this forward's nodes grow (None: a new tree)
        before = None if tree is None else (tree.parents, tree.valid)
        ancestors = check_tree(tokens, parents, valid, len(self._tokens), before)  # [B, P+N, P+N]
        if tree is None:
            tree = _Tree.new(self._sequences)
        waiting = tree.parents.shape[1]  # P
        # A node and its ancestors among all the tree's nodes, so 1 for a child of the root: [B, N] for the new ones
        depth = ancestors[:, waiting:].sum(2)
        positions = self.lengths[:, None] + depth - 1  # [B, N]
        if self.max_length is not None and bool((positions[valid] >= self.max_length).any()):
            raise ValueError(f"{self.name}: the tree outgrew the model's context of {self.max_length} tokens")
        owners, copies = self._plan_leaves(tree, ancestors, parents, valid)  # ValueError past llama.cpp's ids
        new = int(valid.sum())
        self._reserve(new, ids=int(owners.max()) + 1 if owners.numel() else 0)  # a rebuilt cache gets the tree too
        lib = library()
        memory = lib.llama_get_memory(self._context)
        for source, sequence, end in copies:  # a new leaf's sequence: its cached ancestor's path, positions [0, end)
            lib.llama_memory_seq_cp(memory, source, sequence, 0, end)
        sequences, counts = tree_sequences(ancestors[:, waiting:, waiting:], owners[:, 1 + waiting :], valid)
        scored = self._decode(tokens[valid].tolist(), positions[valid].tolist(), sequences, counts=counts, outputs=True)
        logits = self._placed(scored, valid)
        self._tree = _Tree(
            tokens=torch.cat([tree.tokens, tokens], 1),
            parents=torch.cat([tree.parents, parents], 1),
            valid=torch.cat([tree.valid, valid], 1),
            depth=torch.cat([tree.depth, depth], 1),
            ancestors=ancestors,
            owners=owners,
        )
        return logits

    def commit(self, path: torch.Tensor) -> None:
        # columns [B, D]: the kept nodes' columns, root to end, -1 after
        tree, columns = committed_path(self.name, self._tree, path, self.device)
        kept = (columns >= 0).sum(1)  # [B]
        # A sequence that holds each row's kept path: the one a leaf at or below the path's end owns (any such leaf's
        # sequence holds the path root..end, as positions lengths .. lengths + kept - 1)
        leaves = tree.owners[:, 1:]  # [B, P]
        holders = torch.full_like(kept, -1)  # [B]
        if leaves.shape[1]:
            last = torch.nn.functional.pad(columns, (0, 1), value=-1).gather(1, (kept - 1).clamp(min=0)[:, None])
            ends = last.squeeze(1).clamp(min=0)  # [B]: the path's last column (0 for an empty path: not read)
            below = tree.ancestors[torch.arange(len(ends)), :, ends] & (leaves >= 0)  # [B, P]: leaf i at or below end
            holders = leaves.gather(1, below.int().argmax(1, keepdim=True)).squeeze(1)
        lib = library()
        memory = lib.llama_get_memory(self._context)
        rows = zip(self._sequences, kept.tolist(), holders.tolist(), columns.tolist(), strict=True)
        for b, (sequence, depth, holder, path_columns) in enumerate(rows):
            start = len(self._tokens[b])
            if depth and holder == sequence:  # the row's own sequence holds the path: cut what lies below its end
                lib.llama_memory_seq_rm(memory, sequence, start + depth, -1)
            else:  # the row's sequence gives up its tree cells and takes the kept path's from the sequence holding it
                lib.llama_memory_seq_rm(memory, sequence, start, -1)
                if depth:
                    lib.llama_memory_seq_cp(memory, holder, sequence, start, start + depth)
            self._tokens[b] += tree.tokens[b, path_columns[:depth]].tolist()
        # Every other sequence goes, and a cell left in none is free: the rejected nodes' cells.
        for sequence in set(leaves[leaves >= 0].tolist()) - set(self._sequences):
            lib.llama_memory_seq_rm(memory, sequence, -1, -1)
        self._tree = None

    # --- internals ------------------------------------------------------------------------------------------

    def _placed(self, scored: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The logits [B, W, V] of a forward whose ``valid`` [B, W] slots, row-major, scored ``scored`` [n, V]; zeros at
        the holes. With no hole, ``scored`` itself, not copied into a zeroed table."""
        if len(scored) == valid.numel():
            return scored.view(*valid.shape, self.vocab_size)
        logits = torch.zeros(*valid.shape, self.vocab_size)
        logits[valid] = scored
        return logits

    def _no_tree_pending(self, call: str) -> None:
        if self._tree is not None:
            raise RuntimeError(f"{self.name}: {call} after forward_tree; commit the tree's accepted path first")

    def _plan_leaves(
        self, tree: _Tree, ancestors: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The sequences of the tree once the new nodes (``parents``, ``valid`` [B, N], ``ancestors`` over the waiting
        and new nodes, check_tree's) join it: ``owners`` [B, 1+P+N] (``_Tree``), and the copies (source, sequence,
        end) that give each new leaf's fresh sequence its nearest cached ancestor's path, positions [0, end). Changes
        nothing; raises ValueError where the rows and their leaves need more sequence ids than llama.cpp has."""
        waiting = tree.parents.shape[1]
        batch, nodes = valid.shape
        # A new leaf: a valid new node that no valid new node hangs under (column 0 collects the root's children and
        # every hole: only the new nodes' own columns are read)
        has_child = torch.zeros(batch, 1 + waiting + nodes, dtype=torch.bool)
        has_child.scatter_(1, torch.where(valid, parents, 0), True)
        leaves = valid & ~has_child[:, 1 + waiting :]  # [B, N]
        # Its nearest cached ancestor: the last waiting column above it (parents precede children), else the root 0
        above = ancestors[:, waiting:, :waiting] * torch.arange(1, waiting + 1)  # [B, N, P]
        nearest = above.max(2).values if waiting else torch.zeros(batch, nodes, dtype=torch.long)  # [B, N]
        # A sequence holding each cached node's path: the row's for the root, else one a leaf at or below it owns
        carrier = torch.tensor(self._sequences, dtype=torch.long)[:, None]  # [B, 1]
        if waiting:
            held = ancestors[:, :waiting, :waiting] & (tree.owners[:, 1:] >= 0)[:, :, None]  # [B, P, P]: i below j
            carrier = torch.cat([carrier, tree.owners[:, 1:].gather(1, held.int().argmax(1))], 1)  # [B, 1+P]
        ends = self.lengths[:, None] + torch.cat([torch.zeros(batch, 1, dtype=torch.long), tree.depth], 1)  # [B, 1+P]

        owners = torch.cat([tree.owners, torch.full((batch, nodes), -1, dtype=torch.long)], 1).tolist()
        in_use = set(self._sequences) | {s for row in owners for s in row if s >= 0}
        spare = [s for s in range(MAX_ROWS - 1, -1, -1) if s not in in_use]  # popped from the end: lowest first
        nearest_of, carrier_of, end_of = nearest.tolist(), carrier.tolist(), ends.tolist()
        copies, short = [], 0
        for b, column in leaves.nonzero().tolist():  # row by row, each row's leaves in column order
            cached = nearest_of[b][column]
            sequence = owners[b][cached]
            if sequence >= 0:  # a leaf (or the root) that gains children hands its sequence to its first new leaf
                owners[b][cached] = -1
            elif spare:
                sequence = spare.pop()
                if end_of[b][cached]:  # nothing to copy above the root of an empty row
                    copies.append((carrier_of[b][cached], sequence, end_of[b][cached]))
            else:
                short += 1
            owners[b][1 + waiting + column] = sequence
        if short:
            raise ValueError(
                f"{self.name}: these trees need {MAX_ROWS + short} llama.cpp sequences (one per row, and one per leaf "
                f"beyond a row's first), more than the {MAX_ROWS} llama.cpp has in one context: decode fewer rows at "
                "once, or draft trees with fewer leaves"
            )
        return torch.tensor(owners, dtype=torch.long).reshape(batch, 1 + waiting + nodes), copies

    def _reserve(self, new_tokens: int, *, fresh: bool = False, ids: int = 0) -> None:
        """A context with room for every row's tokens, the waiting tree's nodes and ``new_tokens`` more, and for
        sequence ids up to ``ids`` and every row's; a context outgrown mid-generation is replaced and every row's
        tokens (and the waiting tree) decoded again (``fresh``: the rows are new, nothing to keep)."""
        lib = library()
        waiting = 0 if self._tree is None or fresh else int(self._tree.valid.sum())
        cells = sum(len(t) for t in self._tokens) + (0 if fresh else new_tokens + waiting)
        ids = max(ids, max(self._sequences, default=-1) + 1)
        if self._context is not None and cells <= self._cells and ids <= self._rows_max:
            if fresh:
                lib.llama_memory_clear(lib.llama_get_memory(self._context), True)
            return
        if self._context is not None:
            lib.llama_free(self._context)
            self._context = None
        self._cells = max(MIN_CELLS, 2 * cells)
        if ids > self._rows_max and not fresh:  # trees want more: doubled, so that a leaf more is no rebuild each time
            self._rows_max = min(MAX_ROWS, max(ids, 2 * self._rows_max))
        self._rows_max = max(ids, self._rows_max, 1)
        params = lib.llama_context_default_params()
        params.n_ctx = self._cells
        # llama.cpp aborts (GGML_ASSERT) where a context's sequences outnumber its batch's outputs: never here, as
        # BATCH_TOKENS >= MAX_ROWS, unless a test shrinks BATCH_TOKENS
        params.n_batch = params.n_ubatch = max(BATCH_TOKENS, self._rows_max)
        params.n_seq_max = self._rows_max
        params.kv_unified = True  # one stream: a token may be in several sequences (trees), and rows share cells
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        if F32_ATTENTION:
            params.type_k = params.type_v = lib.GGML_TYPE_F32
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._context = lib.llama_init_from_model(self._model, params)
        if not self._context:
            raise RuntimeError(f"{self.name}: llama.cpp could not create a context of {self._cells} cells")
        if not fresh:
            log.info(
                "%s: KV cache grown to %d cells and %d sequences; decoding its %d rows again",
                self.name,
                self._cells,
                self._rows_max,
                len(self._tokens),
            )
            self._decode_all()
            if self._tree is not None:
                self._replay_tree(self._tree)

    def _decode_all(self) -> None:
        """Decode every row's tokens into the (empty) cache, keeping no logits: the prefill."""
        tokens = [token for row in self._tokens for token in row]
        positions = [p for row in self._tokens for p in range(len(row))]
        sequences = [s for row, s in zip(self._tokens, self._sequences, strict=True) for _ in row]
        sequences = np.array(sequences, dtype=np.int32).reshape(-1, 1)
        for start in range(0, len(tokens), BATCH_TOKENS):
            end = start + BATCH_TOKENS
            self._decode(tokens[start:end], positions[start:end], sequences[start:end], outputs=False)
            if self.on_prefill is not None:
                self.on_prefill(min(end, len(tokens)), len(tokens))

    def _replay_tree(self, tree: _Tree) -> None:
        """Decode the waiting ``tree`` into a rebuilt cache that holds the rows (``_decode_all``): each leaf's
        sequence takes its row's tokens, then every node is decoded once, as one tree, keeping no logits."""
        lib = library()
        memory = lib.llama_get_memory(self._context)
        for b, row in enumerate(tree.owners[:, 1:].tolist()):
            for sequence in row:
                if sequence >= 0 and sequence != self._sequences[b] and self._tokens[b]:
                    lib.llama_memory_seq_cp(memory, self._sequences[b], sequence, 0, len(self._tokens[b]))
        if bool(tree.valid.any()):
            sequences, counts = tree_sequences(tree.ancestors, tree.owners[:, 1:], tree.valid)
            positions = (self.lengths[:, None] + tree.depth - 1)[tree.valid]
            self._decode(tree.tokens[tree.valid].tolist(), positions.tolist(), sequences, counts=counts, outputs=False)

    def _decode(
        self,
        tokens: list[int],
        positions: list[int],
        sequences: np.ndarray,
        *,
        outputs: bool | np.ndarray,
        counts: np.ndarray | None = None,
    ) -> torch.Tensor:
        """``llama_decode`` of ``tokens`` at ``positions``, token i in the sequences ``sequences[i, :counts[i]]``
        ([n, k] int32; ``counts`` None: the first only), in calls of at most BATCH_TOKENS; the logits [m, vocab_size]
        of the m tokens ``outputs`` asks for (all, none, or those where a bool array [n] is True), in order."""
        lib = library()
        if counts is None:
            counts = np.ones(len(tokens), dtype=np.int32)
        wanted = np.broadcast_to(np.asarray(outputs, dtype=bool), (len(tokens),))
        parts = []
        for start in range(0, len(tokens), BATCH_TOKENS):
            end = min(start + BATCH_TOKENS, len(tokens))
            batch = self._batch.fill(
                tokens[start:end], positions[start:end], sequences[start:end], counts[start:end], wanted[start:end]
            )
            code = lib.llama_decode(self._context, batch)
            if code != 0:
                raise RuntimeError(f"{self.name}: llama_decode failed with code {code} on {end - start} tokens")
            if scored := int(wanted[start:end].sum()):  # copied out of llama.cpp's buffer, which the next decode reuses
                parts.append(torch.empty(scored, self.vocab_size))
                ctypes.memmove(parts[-1].data_ptr(), lib.llama_get_logits(self._context), parts[-1].nbytes)
        if len(parts) == 1:  # cat would copy again
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0, self.vocab_size)


@dataclass(frozen=True)
class _Tree:
    """A tree awaiting its commit (one or several ``forward_tree`` calls): its P nodes' ``tokens``, ``parents``,
    ``valid`` and ``depth`` [B, P] (depth 1: a child of the root), ``ancestors`` [B, P, P] (check_tree's), and
    ``owners`` [B, 1+P] int64: the llama.cpp sequence a leaf owns, which holds its row's cached tokens and the path
    root..leaf, -1 for the other nodes (column 0 is the root, which owns its row's sequence until a node takes it)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    owners: torch.Tensor

    @staticmethod
    def new(sequences: list[int]) -> _Tree:
        """No node yet: each row's root owns the row's sequence."""
        batch = len(sequences)
        none = torch.zeros(batch, 0, dtype=torch.long)
        return _Tree(
            none,
            none,
            none.bool(),
            none,
            torch.zeros(batch, 0, 0, dtype=torch.bool),
            torch.tensor(sequences, dtype=torch.long).reshape(batch, 1),
        )


def tree_sequences(ancestors: torch.Tensor, owners: torch.Tensor, valid: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The llama.cpp sequences of a tree's valid nodes, row-major as ``tokens[valid]``: each node is in the sequence of
    every leaf at or below it, so it attends to what that leaf's path attends to up to its own position: its row, its
    ancestors and itself. ``ancestors`` [B, N, N] bool ([b, i, j]: node j + 1 is node i + 1 or above it, check_tree's),
    ``owners`` [B, N] int64 (the sequence node i owns as a leaf, else -1), ``valid`` [B, N] bool. Returns
    (sequences [n, k] int32, each node's leaves' first, and counts [n] int32, how many are its)."""
    member = ancestors.transpose(1, 2) & (owners >= 0)[:, None, :]  # [B, N, N]: node i is in the sequence of leaf j
    member, owned = member[valid], owners[:, None, :].expand_as(member)[valid]  # [n, N] each
    counts = member.sum(1)  # >= 1: a valid node is a leaf or has one below it
    width = int(counts.max()) if len(counts) else 0
    first = (~member).int().argsort(dim=1, stable=True)[:, :width]  # [n, k]: the member leaves' columns first
    return owned.gather(1, first).numpy().astype(np.int32), counts.numpy().astype(np.int32)


class _Batch:
    """A ``llama_batch`` over numpy arrays this object owns: filled by slices, no per-token ctypes call. A token may
    be in several sequences (a tree's node in those of the leaves below it): up to MAX_ROWS, a row of ``seq`` each."""

    def __init__(self, capacity: int):
        lib = library()
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros((capacity, MAX_ROWS), dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        seq_type = ctypes.POINTER(lib.llama_seq_id)
        address, step = self.seq.ctypes.data, self.seq.strides[0]
        self.seq_pointers = (seq_type * capacity)(*(ctypes.cast(address + i * step, seq_type) for i in range(capacity)))
        self.batch = lib.llama_batch()
        self.batch.token = self.token.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        self.batch.embd = None
        self.batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = self.seq_pointers
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(
        self, tokens: list[int], positions: list[int], sequences: np.ndarray, counts: np.ndarray, outputs: np.ndarray
    ):
        """``outputs`` [n] bool: the tokens whose logits llama.cpp computes."""
        n, width = sequences.shape
        self.token[:n], self.pos[:n], self.logits[:n] = tokens, positions, outputs
        self.seq[:n, :width], self.n_seq_id[:n] = sequences, counts
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
    log.log(NOTICE, "requantizing %s to %s (once: kept as %s)", path.name, quant, out)
    try:
        if lib.llama_model_quantize(str(path).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not requantize {path} to {quant}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def adapter_name(name_or_path: str, quant: str | None = None, vocabulary: int | None = None) -> str:
    """The name ``load_llamacpp`` gives the model it loads with these arguments (which step-latency caches are keyed
    by: ``auto.cached_latency``)."""
    label = ", ".join(["llama.cpp", *([quant] if quant else []), *([f"{vocabulary} tokens"] if vocabulary else [])])
    return f"{name_or_path} ({label})"


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
    from .convert import gguf_tokenizer, load_preset_tokenizer, materialize
    from .presets import PRESETS

    if name_or_path in PRESETS:
        preset = PRESETS[name_or_path]
        path = materialize(preset, progress=progress)
        tokenizer = load_preset_tokenizer(preset, progress=progress)
        eos = preset.eos_token_ids
    elif name_or_path.endswith(".gguf"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"no GGUF file at {name_or_path}")
        path = Path(name_or_path).resolve()
        tokenizer, eos = gguf_tokenizer(path), None
    else:
        raise ValueError(
            f"the llama.cpp backend runs GGUF files: {name_or_path!r} is neither a preset nor a .gguf file "
            "(use --backend hf for a transformers folder or hub id)"
        )
    if quant is not None:
        path = requantize(Path(path), quant)
    name = adapter_name(name_or_path, quant, vocabulary)
    if vocabulary is None:
        return LlamaCppModel(path, tokenizer, name=name, eos_token_ids=eos, threads=threads)
    cut = cut_vocabulary(Path(path), vocabulary)
    kept, reads = read_cut(cut)
    model = LlamaCppModel(cut, name=name, threads=threads)
    eos = eos or tuple(int(kept[t]) for t in model.eos_token_ids)  # the GGUF's own, in the cut's ids
    return VocabularyCut(model, kept, reads, eos_token_ids=eos, tokenizer=tokenizer)
