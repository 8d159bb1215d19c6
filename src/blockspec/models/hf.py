"""HFModel: the LanguageModel interface over a transformers causal LM, with a per-row KV cache (`slots`).

Prompts are prefilled in groups of similar length (``prefill_groups``), so a batch's short prompts are not padded to
its longest; a prompt longer than the prefill budget is prefilled in chunks, each attending to the ones before it
through the cache. During its own forwards HFModel switches sdpa models to ``attention.grouped_sdpa``; between them
the caller's model is as the caller left it (its own ``generate`` runs transformers' kernels).

HFModel is a ``TreeLanguageModel``: ``forward_tree`` scores a drafted tree in one forward (or grows the waiting tree
by a level), each node at its depth's position under an ancestor mask (``slots.tree_mask``), and ``commit`` moves
the accepted path's keys and values to the tree's first slots, so a tree step grows the cache by the path it keeps
and never by the nodes it drops.

``load.load_model`` loads one by name: a bundled preset (`convert`), a GGUF file, a folder or a hub id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from .attention import GROUPED_SDPA, unsupported_attention
from .base import check_tree, committed_path, left_pad
from .slots import SlotCache, SlotLayer, slot_mask, tree_mask

PREFILL_TOKENS = 2048  # padded tokens per prefill forward: enough for efficient matmuls, bounds activations


class HFModel:
    """Wraps an already-loaded transformers ``PreTrainedModel`` (and optionally its tokenizer), without changing it:
    only for the duration of HFModel's own forwards is the model in eval mode and, if it uses sdpa attention, on
    ``grouped_sdpa``, which computes the same attention without copying the cache. Raises ValueError for a model
    whose attention the slot mask cannot express (``attention.unsupported_attention``).

    ``on_prefill(done, total)``, if set, is called after each prefill forward with the prompt tokens prefilled so
    far and the total: a long prompt on a slow CPU takes minutes, and a caller can show that it advances.
    """

    def __init__(
        self, model, tokenizer=None, *, name: str | None = None, on_prefill: Callable[[int, int], None] | None = None
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(model, "name_or_path", None) or type(model).__name__
        head = model.get_output_embeddings()  # an int8 (quantized) head has out_features but no weight tensor
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        config = model.config.get_text_config(decoder=True)
        reason = unsupported_attention(config)
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        # What `_own_settings` switches per forward, listed once: every module, and every config a module reads its
        # attention implementation from (a target-prefix companion's layers read the target's); no config for a
        # model whose attention does not dispatch on it, where set_attn_implementation would switch none either.
        self._modules = tuple(model.modules())
        configs = {id(c): c for m in self._modules if isinstance(c := getattr(m, "config", None), PreTrainedConfig)}
        self._configs = tuple(configs.values()) if model._can_set_attn_implementation() else ()
        self.max_length = getattr(config, "max_position_embeddings", None)
        self.num_layers = int(config.num_hidden_layers)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.prefill_tokens = PREFILL_TOKENS
        self.on_prefill = on_prefill
        self._cache = SlotCache(self.num_layers, self.device)
        self._tree: _Tree | None = None  # the nodes of the forward_tree calls since the last commit

    def __repr__(self) -> str:
        return f"HFModel({self.name}, {self.dtype}, {self.device})"

    @property
    def lengths(self) -> torch.Tensor:
        return self._cache.lengths

    # --- the LanguageModel interface ----------------------------------------------------------------------

    def prefill(self, sequences: list[list[int]]) -> None:
        longest = max((len(s) for s in sequences), default=0)
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(f"{self.name}: a prompt of {longest} tokens exceeds the context of {self.max_length}")
        self._cache.start([len(s) for s in sequences])
        self._tree = None
        done, total = 0, sum(len(s) for s in sequences)
        for rows in prefill_groups([len(s) for s in sequences], self.prefill_tokens):
            tokens, valid = left_pad([sequences[b] for b in rows])
            tokens, valid, width = tokens.to(self.device), valid.to(self.device), tokens.shape[1]
            positions = valid.cumsum(1) - 1
            slot_pos = positions.masked_fill(~valid, -1)
            part = self._cache.group(width)
            # One forward per group, except for a row alone over the budget: its columns [start, end) go in chunks,
            # each appended to `part` and attending to the slots before it, as a decoding forward does.
            chunk = max(1, self.prefill_tokens // len(rows))
            for start in range(0, width, chunk):
                end = min(start + chunk, width)
                mask = slot_mask(slot_pos[:, :end], end - start, self.dtype)
                self._call(part, tokens[:, start:end], mask, positions[:, start:end], logits_to_keep=1)
                done += int(valid[:, start:end].sum())
                if self.on_prefill is not None:
                    self.on_prefill(done, total)
            self._cache.place(rows, part, slot_pos)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        self._no_tree_pending("forward")
        if tokens.numel() == 0:
            return self._no_logits(tokens[:, -1:] if last else tokens)
        return self._run(tokens, valid, logits_to_keep=1 if last else 0)

    def rollback(self, lengths: torch.Tensor) -> None:
        self._no_tree_pending("rollback")
        self._cache.rollback(lengths)

    def select(self, rows: torch.Tensor) -> None:
        self._no_tree_pending("select")
        self._cache.select(rows)

    # --- the TreeLanguageModel interface --------------------------------------------------------------------

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        tokens, parents, valid = (t.to(self.device) for t in (tokens, parents, valid))
        tree = self._tree  # the nodes waiting for a commit, which this forward's nodes grow (None: a new tree)
        waiting = 0 if tree is None else tree.parents.shape[1]
        before = None if tree is None else (tree.parents, tree.valid)
        ancestors = check_tree(tokens, parents, valid, len(self.lengths), before)  # [B, P+N, P+N]
        nodes = tokens.shape[1]
        if tree is not None:
            parents, valid = torch.cat([tree.parents, parents], dim=1), torch.cat([tree.valid, valid], dim=1)
        # A node and its ancestors among all the tree's nodes, so 1 for a child of the root: [B, N] for the new ones
        depth = ancestors[:, waiting:].sum(2)
        positions = self.lengths[:, None] + depth - 1  # [B, N]
        if self.max_length is not None and bool((positions[valid[:, waiting:]] >= self.max_length).any()):
            raise ValueError(f"{self.name}: the tree outgrew the model's context of {self.max_length} tokens")
        start = self._cache.extend_tree(nodes, waiting)
        if tokens.numel() == 0:
            logits = self._no_logits(tokens)
        else:  # the new nodes' queries over the cached slots, the waiting nodes and their own
            mask = tree_mask(self._cache.slot_pos, ancestors, valid, self.dtype)[:, :, waiting:]
            logits = self._call(self._cache.layers, tokens, mask, positions, logits_to_keep=0)
        self._tree = _Tree(parents, valid, start)
        return logits

    def commit(self, path: torch.Tensor) -> None:
        tree, columns = committed_path(self.name, self._tree, path, self.device)  # columns [B, L]
        self._cache.keep_path(tree.start, columns)
        self._tree = None

    # --- internals ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _run(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        positions, slot_pos = self._cache.extend(valid)  # [B, S], [B, T+S]
        if self.max_length is not None and bool((positions[valid] >= self.max_length).any()):
            raise ValueError(f"{self.name}: the sequence outgrew the model's context of {self.max_length} tokens")
        mask = slot_mask(slot_pos, tokens.shape[1], self.dtype)
        logits = self._call(self._cache.layers, tokens, mask, positions, logits_to_keep)
        self._cache.commit(slot_pos, valid)
        return logits

    @torch.no_grad()
    def _call(
        self,
        layers: list[SlotLayer],
        tokens: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        logits_to_keep: int,
    ) -> torch.Tensor:
        """The model's forward of ``tokens`` [B, S] at ``positions``, appended to ``layers``, under the additive
        ``mask`` [B, 1, S, T+S] over the cached slots and the new ones (``slot_mask``, ``tree_mask``)."""
        with self._own_settings():
            return self.model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions.clamp(min=0),  # a hole's position is irrelevant: nobody attends to it
                past_key_values=Cache(layers=[*layers]),  # a list of the base type transformers declares
                use_cache=True,
                logits_to_keep=logits_to_keep,
            ).logits

    def _no_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits [B, S, V] of ``tokens`` [B, S] with no rows or no tokens: none to score, and transformers'
        forward takes no empty input."""
        return torch.zeros(*tokens.shape, self.vocab_size, dtype=self.dtype, device=self.device)

    def _no_tree_pending(self, call: str) -> None:
        if self._tree is not None:
            raise RuntimeError(f"{self.name}: {call} after forward_tree; commit the tree's accepted path first")

    @contextlib.contextmanager
    def _own_settings(self) -> Iterator[None]:
        """Eval mode, and ``grouped_sdpa`` for configs on sdpa, while the block runs; then (also after an error) the
        caller's flags and implementations are back. Flags are set one by one, so a mix of train and eval returns."""
        training = [module for module in self._modules if module.training]
        sdpa = [config for config in self._configs if config._attn_implementation == "sdpa"]
        for module in training:
            module.training = False
        for config in sdpa:  # the attribute set_attn_implementation writes, minus checks a model on sdpa passes
            config._attn_implementation_internal = GROUPED_SDPA
        try:
            yield
        finally:
            for module in training:
                module.training = True
            for config in sdpa:
                config._attn_implementation_internal = "sdpa"


@dataclass(frozen=True)
class _Tree:
    """A tree awaiting its commit (one or several forwards): its nodes' ``parents`` and ``valid`` [B, N], in slots
    from ``start``."""

    parents: torch.Tensor
    valid: torch.Tensor
    start: int


def prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows to prefill together: by decreasing length, as many as fit ``budget`` tokens once padded to the
    group's longest (at least one), so short prompts are not padded to the batch's longest. Empty rows need no
    forward and are left out."""
    groups: list[list[int]] = []
    for b in sorted((b for b, n in enumerate(lengths) if n), key=lambda b: -lengths[b]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        for token in [eos] if isinstance(eos, int) else (eos or []):
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)
