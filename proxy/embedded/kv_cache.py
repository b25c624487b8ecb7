"""A left-padded, batched KV cache that rows join and leave between decode steps.

Layout, per layer: keys and values of shape ``(B, H_kv, capacity, D)``. Column
``length - 1`` holds every row's newest cached token; a row with ``n`` cached
tokens occupies columns ``[length - n, length)`` and the columns before are
padding, masked out by ``mask`` ``(B, capacity)``. Padding holds zeros, never
uninitialised memory: masked attention weights are exactly 0, and ``0 * NaN``
would still poison the output.

One decode step feeds one new token per row: the model writes its keys and
values into column ``length`` in place (no per-step concatenation), and
:meth:`commit` advances ``length``. Capacity grows geometrically.

HF models talk to the cache through :class:`transformers.cache_utils.Cache`;
:meth:`BatchKVCache.as_hf_cache` wraps the buffers in layers that implement the
small part of HF's cache-layer protocol the decoder uses.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_CAPACITY = 64


class _BufferLayer(DynamicLayer):
    """One layer's view of :class:`BatchKVCache`, in HF's cache-layer protocol."""

    def __init__(self, owner: BatchKVCache, layer_idx: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        self._owner = owner
        self._layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        """Nothing to do: the owner's buffers already exist."""

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new step's keys/values after the cached ones; return all of them."""
        return self._owner.write(self._layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        """Cached columns (padding included), before this step's write."""
        return self._owner.length


class BatchKVCache:
    """Padded per-layer key/value buffers for the rows of the running batch.

    Shape: keys/values ``(B, H_kv, capacity, D)``; ``mask`` ``(B, capacity)``
    with 1 for real tokens.
    """

    def __init__(self, num_layers: int, dtype: torch.dtype = torch.float32) -> None:
        self.num_layers = num_layers
        self.dtype = dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.length = 0

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return int(self.mask.shape[0])

    @property
    def capacity(self) -> int:
        """Columns allocated per row."""
        return int(self.mask.shape[1])

    # ---- rows joining and leaving -------------------------------------------------

    def add_row(self, row_keys: list[torch.Tensor], row_values: list[torch.Tensor]) -> int:
        """Append a prefilled row; returns its index.

        ``row_keys[l]`` / ``row_values[l]``: ``(1, H_kv, n, D)`` for one request's
        ``n`` prompt tokens (as produced by a single-sequence prefill).
        """
        n = int(row_keys[0].shape[-2])
        if self.batch_size == 0:
            self._reset(row_keys[0], max(n, 1))
        if n > self.length:
            self._shift_right(n - self.length)
        self._ensure_capacity(self.length + 1)
        start = self.length - n
        new_mask = torch.zeros(1, self.capacity, dtype=torch.long)
        new_mask[0, start : self.length] = 1
        self.mask = torch.cat([self.mask, new_mask])
        for layer in range(self.num_layers):
            for buffers, row in ((self.keys, row_keys[layer]), (self.values, row_values[layer])):
                new_row = buffers[layer].new_zeros((1, *buffers[layer].shape[1:]))
                new_row[:, :, start : self.length] = row
                buffers[layer] = torch.cat([buffers[layer], new_row])
        return self.batch_size - 1

    def keep_rows(self, indices: list[int]) -> None:
        """Keep only the rows at ``indices`` (in that order) and drop leading all-padding columns."""
        if not indices:
            self.keys, self.values = [], []
            self.mask = torch.zeros(0, 0, dtype=torch.long)
            self.length = 0
            return
        index = torch.tensor(indices, dtype=torch.long)
        self.mask = self.mask.index_select(0, index)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        real_columns = self.mask[:, : self.length].any(dim=0).nonzero()
        first_real = int(real_columns[0]) if real_columns.numel() else self.length
        if first_real > 0:
            self._shift_left(first_real)

    # ---- one decode step -----------------------------------------------------------

    def step_attention_mask(self) -> torch.Tensor:
        """Additive attention mask ``(B, 1, 1, length + 1)`` for a step adding one token per row.

        0 where a row attends, the dtype's minimum on padding. HF uses a 4D mask
        as given, which skips its per-step mask construction (vmap-based and
        slow for a padded batch); with one query per row there is no causal
        part to add.
        """
        self._ensure_capacity(self.length + 1)
        self.mask[:, self.length] = 1
        keep = self.mask[:, : self.length + 1].bool()  # (B, T + 1)
        additive = torch.zeros(keep.shape, dtype=self.dtype).masked_fill_(
            ~keep, torch.finfo(self.dtype).min
        )
        return additive[:, None, None, :]  # (B, 1, 1, T + 1)

    def write(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``(B, H_kv, q, D)`` new states at column ``length``; return the filled views."""
        q = int(key_states.shape[-2])
        end = self.length + q
        self.keys[layer][:, :, self.length : end] = key_states
        self.values[layer][:, :, self.length : end] = value_states
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def commit(self, num_tokens: int = 1) -> None:
        """Advance past the columns the last forward pass wrote."""
        self.length += num_tokens

    def as_hf_cache(self) -> Cache:
        """This cache in HF's ``Cache`` interface, for one forward pass."""
        return Cache(layers=[_BufferLayer(self, i) for i in range(self.num_layers)])

    # ---- buffer management ----------------------------------------------------------

    def _reset(self, like: torch.Tensor, length: int) -> None:
        _, heads, _, head_dim = like.shape
        capacity = max(_MIN_CAPACITY, 2 * length)
        shape = (0, heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self.mask = torch.zeros(0, capacity, dtype=torch.long)
        self.length = length

    def _ensure_capacity(self, columns: int) -> None:
        if columns <= self.capacity:
            return
        self._reallocate(
            max(columns, 2 * self.capacity), src_start=0, dst_start=0, count=self.length
        )

    def _shift_right(self, offset: int) -> None:
        """Move every row ``offset`` columns right (new padding on the left)."""
        capacity = max(self.capacity, 2 * (self.length + offset) + 1)
        self._reallocate(capacity, src_start=0, dst_start=offset, count=self.length)
        self.length += offset

    def _shift_left(self, offset: int) -> None:
        """Drop the first ``offset`` columns (all padding)."""
        count = self.length - offset
        self._reallocate(self.capacity, src_start=offset, dst_start=0, count=count)
        self.length = count

    def _reallocate(self, capacity: int, *, src_start: int, dst_start: int, count: int) -> None:
        src = slice(src_start, src_start + count)
        dst = slice(dst_start, dst_start + count)
        mask = self.mask.new_zeros((self.batch_size, capacity))
        mask[:, dst] = self.mask[:, src]
        self.mask = mask
        for buffers in (self.keys, self.values):
            for layer, old in enumerate(buffers):
                new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
                new[:, :, dst] = old[:, :, src]
                buffers[layer] = new
