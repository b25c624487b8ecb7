"""The left-padded batch cache: layout when rows join and leave."""

from __future__ import annotations

import torch
from proxima.proxy.embedded.kv_cache import BatchKVCache


def _row(length: int, fill: float) -> list[torch.Tensor]:
    return [torch.full((1, 2, length, 4), fill) for _ in range(2)]  # 2 layers, (1, H, L, D)


def test_rows_are_left_padded_to_a_common_end() -> None:
    cache = BatchKVCache(num_layers=2)
    cache.add_row(_row(3, 1.0), _row(3, -1.0))
    cache.add_row(_row(5, 2.0), _row(5, -2.0))  # longer: the first row shifts right
    cache.add_row(_row(2, 3.0), _row(2, -3.0))
    assert cache.length == 5
    assert cache.mask[:, :5].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    keys = cache.keys[1][:, 0, :5, 0]  # (B, T) of layer 1, head 0, dim 0
    assert keys.tolist() == [[0, 0, 1, 1, 1], [2, 2, 2, 2, 2], [0, 0, 0, 3, 3]]
    assert cache.values[0][2, 1, 3:5, 2].tolist() == [-3, -3]


def test_step_writes_one_column_and_dropping_rows_trims_padding() -> None:
    cache = BatchKVCache(num_layers=2)
    cache.add_row(_row(2, 1.0), _row(2, 1.0))
    cache.add_row(_row(6, 2.0), _row(6, 2.0))
    mask = cache.step_attention_mask()
    assert mask.shape == (2, 1, 1, 7)
    padding = torch.finfo(torch.float32).min
    assert mask[:, 0, 0].tolist() == [[padding] * 4 + [0.0] * 3, [0.0] * 7]
    new = torch.full((2, 2, 1, 4), 9.0)
    for layer in range(2):
        keys, values = cache.write(layer, new, new)
        assert keys.shape == (2, 2, 7, 4)
    cache.commit()
    cache.keep_rows([0])  # the long row leaves; four leading padding columns go
    assert cache.length == 3
    assert cache.mask[:, :3].tolist() == [[1, 1, 1]]
    assert cache.keys[0][0, 0, :3, 0].tolist() == [1, 1, 9]
    cache.keep_rows([])
    assert cache.batch_size == 0


def test_capacity_grows_and_keeps_contents() -> None:
    cache = BatchKVCache(num_layers=2)
    cache.add_row(_row(100, 5.0), _row(100, 5.0))
    start_capacity = cache.capacity
    step = torch.full((1, 2, 1, 4), 7.0)
    for _ in range(start_capacity):
        cache.step_attention_mask()
        for layer in range(2):
            cache.write(layer, step, step)
        cache.commit()
    assert cache.capacity > start_capacity
    assert cache.length == 100 + start_capacity
    assert bool((cache.keys[1][0, :, :100] == 5.0).all())
    assert bool((cache.keys[1][0, :, 100 : cache.length] == 7.0).all())
    assert int(cache.mask[0, : cache.length].sum()) == cache.length
