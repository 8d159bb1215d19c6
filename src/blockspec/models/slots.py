"""HFModel's KV cache: a preallocated buffer of *slots* per row, which rolls back per row for free.

transformers' DynamicCache cuts every row at once (``crop(-k)``) and grows by concatenation. Speculative decoding
needs per-row rollback, so each forward appends S slots to every row; each slot records the position of the token
in it, or -1 for a hole (a rolled-back token or padding). An explicit 4D attention mask (``slot_mask``) lets a token
see exactly the earlier non-hole slots of its row, and explicit position ids keep every row's positions contiguous,
so holes cost nothing but memory until an occasional compaction squeezes them out. Rolling back is a mask update.

A drafted tree is appended the same way, N slots per row, under ``tree_mask`` (each node sees the cached tokens and
its own ancestors), in one forward or level by level (each forward appends its nodes after the waiting ones);
``keep_path`` then moves each row's accepted path to the first of those slots and drops the rest, so a tree step
leaves the cache as a plain forward of the path would.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import DynamicLayer

log = logging.getLogger(__name__)


class SlotCache:
    """The slots of B rows in every layer: ``layers`` (one ``SlotLayer`` each), ``slot_pos`` [B, T] int64 (the
    position of each slot's token, -1 for a hole) and ``lengths`` [B] int64 (tokens per row)."""

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers, self.device = num_layers, device
        self.layers: list[SlotLayer] = []
        self.slot_pos = torch.zeros(0, 0, dtype=torch.long, device=device)  # [B, T]
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # [B]

    def start(self, lengths: list[int]) -> None:
        """A new batch of rows of ``lengths`` tokens, all holes until ``place`` fills them."""
        self.layers = [SlotLayer() for _ in range(self.num_layers)]
        self.slot_pos = torch.full((len(lengths), max(lengths, default=0)), -1, dtype=torch.long, device=self.device)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)

    def group(self, width: int) -> list[SlotLayer]:
        """Empty layers of ``width`` slots, for prefilling a group of rows apart from the batch."""
        part = [SlotLayer() for _ in range(self.num_layers)]
        for layer in part:
            layer.reserve(width)
        return part

    def place(self, rows: list[int], part: list[SlotLayer], slot_pos: torch.Tensor) -> None:
        """Copy the prefilled group ``part`` (``slot_pos`` [len(rows), W]) into ``rows``, right-aligned: every
        row's last token in the batch's last slot."""
        batch, longest = self.slot_pos.shape
        index = torch.tensor(rows, device=self.device)
        self.slot_pos[index, longest - slot_pos.shape[1] :] = slot_pos
        for layer, filled in zip(self.layers, part):
            layer.place(index, filled, batch, longest)

    def extend(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for the new slots ``valid`` [B, S] (False: a hole); returns their positions [B, S] and the slot
        positions of the cache with them [B, T+S], for ``commit`` once a forward has filled them."""
        self._make_room(valid.shape[1])
        positions = self.lengths[:, None] + valid.cumsum(1) - 1  # [B, S]: contiguous per row over valid slots
        return positions, torch.cat([self.slot_pos, positions.masked_fill(~valid, -1)], dim=1)

    def commit(self, slot_pos: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the slots ``extend`` returned, once every layer holds them."""
        assert all(layer.used == slot_pos.shape[1] for layer in self.layers)
        self.slot_pos = slot_pos
        self.lengths = self.lengths + valid.sum(1)

    def extend_tree(self, nodes: int, waiting: int = 0) -> int:
        """Room for ``nodes`` slots per row after the cache's and the ``waiting`` slots of a tree already appended;
        returns the first slot of the tree. The forward that fills them runs under ``tree_mask``; ``keep_path`` must
        follow it (until then ``slot_pos`` does not cover them). A tree that grows only gets room: a compaction
        would move the slots of its waiting nodes."""
        if waiting:
            for layer in self.layers:
                layer.reserve(self.slot_pos.shape[1] + waiting + nodes)
        else:
            self._make_room(nodes)
        return self.slot_pos.shape[1]

    def keep_path(self, start: int, columns: torch.Tensor) -> None:
        """After a tree forward into the slots from ``start`` on: keep row b's nodes ``columns[b]`` [L] (offsets from
        ``start``, root to leaf; -1 after the path) as its next tokens, in slots start .. start + L - 1, and drop the
        others. A row whose path is shorter than L gets holes after it."""
        kept = columns >= 0  # [B, L]
        for layer in self.layers:
            layer.gather(columns.clamp(min=0), start)  # a hole keeps some node's (finite) keys: nobody sees them
        positions = self.lengths[:, None] + torch.arange(columns.shape[1], device=self.device)  # the path's, [B, L]
        self.slot_pos = torch.cat([self.slot_pos, positions.masked_fill(~kept, -1)], dim=1)
        self.lengths = self.lengths + kept.sum(1)

    def rollback(self, lengths: torch.Tensor) -> None:
        if bool((lengths > self.lengths).any()):
            raise ValueError(f"rollback can only shorten rows: {lengths.tolist()} > {self.lengths.tolist()}")
        self.slot_pos = self.slot_pos.masked_fill(self.slot_pos >= lengths[:, None], -1)
        self.lengths = lengths.clone()

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        for layer in self.layers:
            layer.select(rows)
        self.slot_pos, self.lengths = self.slot_pos[rows], self.lengths[rows]

    def _make_room(self, new: int) -> None:
        """Compact when holes are at least half the slots or the buffers are full; grow only if still needed."""
        used = self.slot_pos.shape[1]
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        capacity = self.layers[0].capacity if self.layers and self.layers[0].keys is not None else 0
        if used > 32 and (used >= 2 * longest or used + new > capacity):
            # Stable sort puts each row's holes (-1) first and its tokens in position order after them; the
            # last `longest` columns hold every row's tokens, right-aligned.
            order = self.slot_pos.argsort(dim=1, stable=True)[:, used - longest :]
            for layer in self.layers:
                layer.gather(order)
            self.slot_pos = self.slot_pos.gather(1, order)
            log.debug("compacted a KV cache from %d to %d slots", used, longest)
        for layer in self.layers:
            layer.reserve(self.slot_pos.shape[1] + new)


def slot_mask(slot_pos: torch.Tensor, new: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [B, 1, S, T+S] for the last ``new`` slots of ``slot_pos`` [B, T+S].

    Query slot q sees key slot k when k <= q and k holds a token (not a hole); every slot also sees itself, so
    a hole's query row is never all -inf (that would put NaN in its keys and values, and NaN * 0 is NaN).
    """
    total = slot_pos.shape[1]
    key = torch.arange(total, device=slot_pos.device)
    query = key[total - new :, None]  # [S, 1]
    visible = ((key <= query) & (slot_pos[:, None, :] >= 0)) | (key == query)  # [B, S, T+S]
    mask = torch.zeros(visible.shape, dtype=dtype, device=slot_pos.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def tree_mask(slot_pos: torch.Tensor, ancestors: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype):
    """Additive attention mask [B, 1, N, T+N] for N tree nodes appended after the cache's slots ``slot_pos`` [B, T].

    Node i sees every cached slot that holds a token, and node j when ``ancestors`` [B, N, N] bool says j is i or
    an ancestor of i and j is ``valid`` [B, N] (not a hole); every node also sees itself, so a hole's query row is
    never all -inf (as in ``slot_mask``).
    """
    nodes = ancestors.shape[1]
    cached = (slot_pos[:, None, :] >= 0).expand(-1, nodes, -1)  # [B, N, T]
    own = torch.eye(nodes, dtype=torch.bool, device=slot_pos.device)
    visible = torch.cat([cached, (ancestors & valid[:, None, :]) | own], dim=2)  # [B, N, T+N]
    mask = torch.zeros(visible.shape, dtype=dtype, device=slot_pos.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


class SlotLayer(DynamicLayer):
    """One layer's keys and values in a preallocated [B, H, capacity, D] buffer; ``used`` slots are filled."""

    def __init__(self):
        super().__init__()
        self.used = 0
        self.capacity = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        if keys is None or values is None:
            keys = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[3])
            values = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[3])
            self.keys, self.values = keys, values
        new = key_states.shape[2]
        keys[:, :, self.used : self.used + new] = key_states
        values[:, :, self.used : self.used + new] = value_states
        self.used += new
        return keys[:, :, : self.used], values[:, :, : self.used]

    def get_seq_length(self) -> int:
        return self.used

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.used + query_length, 0

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` in all; grows by doubling, so appends are amortised O(1)."""
        if slots <= self.capacity:
            return
        self.capacity = max(slots, 2 * self.capacity, 64)
        if self.keys is not None and self.values is not None:
            keys = self.keys.new_empty(*self.keys.shape[:2], self.capacity, self.keys.shape[3])
            values = self.values.new_empty(*self.values.shape[:2], self.capacity, self.values.shape[3])
            keys[:, :, : self.used] = self.keys[:, :, : self.used]
            values[:, :, : self.used] = self.values[:, :, : self.used]
            self.keys, self.values = keys, values

    def gather(self, order: torch.Tensor, start: int = 0) -> None:
        """Keep, per row b, the slots ``start + order[b]`` [T'] (in that order) as slots start .. start + T' - 1; the
        slots before ``start`` stay as they are."""
        if self.keys is None or self.values is None:
            return
        index = order[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
        end = start + order.shape[1]
        self.keys[:, :, start:end] = self.keys[:, :, start : self.used].gather(2, index)
        self.values[:, :, start:end] = self.values[:, :, start : self.used].gather(2, index)
        self.used = end

    def place(self, rows: torch.Tensor, part: SlotLayer, batch: int, slots: int) -> None:
        """Copy ``part``'s filled slots into rows ``rows`` (of ``batch``), right-aligned in the first ``slots``."""
        if part.keys is None or part.values is None:
            return
        keys, values = self.keys, self.values
        if keys is None or values is None:  # zeros, not garbage, in the slots no row fills: masked keys must be finite
            self.lazy_initialization(part.keys, part.values)
            self.capacity = max(self.capacity, slots)
            keys = part.keys.new_zeros(batch, part.keys.shape[1], self.capacity, part.keys.shape[3])
            values = part.values.new_zeros(batch, part.values.shape[1], self.capacity, part.values.shape[3])
            self.keys, self.values, self.used = keys, values, slots
        keys[rows, :, slots - part.used : slots] = part.keys[:, :, : part.used]
        values[rows, :, slots - part.used : slots] = part.values[:, :, : part.used]

    def select(self, rows: torch.Tensor) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]
