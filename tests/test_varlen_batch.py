"""The step's tensors for a device: one packed copy of the host arrays, viewed back, holding the same step (a GPU
step reads what a CPU step reads; tests/test_cuda.py runs it on a GPU)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.attention.backend import host_arrays_to
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.varlen_batch import varlen_batch


def test_host_arrays_go_over_in_one_copy_with_their_shapes():
    a, b = np.arange(6, dtype=np.int32).reshape(2, 3), np.array([7, 8], dtype=np.int64)
    ta, tb = host_arrays_to("cpu", a, b)
    assert ta.dtype == tb.dtype == torch.int64 and ta.shape == (2, 3) and tb.tolist() == [7, 8]
    assert ta.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert ta.untyped_storage().data_ptr() == tb.untyped_storage().data_ptr()   # (views of one buffer)


def test_metadata_moved_holds_the_same_step():
    states = [CachedRequestState.create(f"r{i}", list(range(100 + i, 100 + i + n)), n, SamplingParams(), blocks, 0,
                                        None)
              for i, (n, blocks) in enumerate([(20, [3, 7]), (5, [9]), (37, [1, 2, 4])])]
    _, _, md = varlen_batch(states, np.array([0, 4, 30]), np.array([20, 1, 7]), 16)
    moved = md.to("cpu")
    for name in ("slot_mapping", "block_table", "query_start_loc", "seq_lens"):
        a, b = getattr(md, name), getattr(moved, name)
        assert torch.equal(a.long(), b) and b.dtype == torch.int64, name
    assert moved.slot_mapping[-1] == 4 * 16 + 36 % 16 and moved.query_start_loc.tolist() == [0, 20, 21, 28]
    assert moved.query_start_loc_np is md.query_start_loc_np and moved.max_seq_len == 37
