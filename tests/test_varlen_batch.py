"""The step's flat batch, and its one-copy form for a device: the same tensors, so a GPU step reads what a CPU
step reads (tests/test_cuda.py runs it on a GPU)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.varlen_batch import _on_device, varlen_batch


def test_one_copy_to_a_device_holds_the_same_step():
    states = [CachedRequestState.create(f"r{i}", list(range(100 + i, 100 + i + n)), n, SamplingParams(), blocks, 0,
                                        None)
              for i, (n, blocks) in enumerate([(20, [3, 7]), (5, [9]), (37, [1, 2, 4])])]
    start, n = np.array([0, 4, 30]), np.array([20, 1, 7])
    ids, pos, md = varlen_batch(states, start, n, 16)
    ids2, pos2, md2 = _on_device(ids.numpy(), pos.numpy(), md, "cpu")
    assert torch.equal(ids2, ids) and torch.equal(pos2, pos)
    for name in ("slot_mapping", "block_table", "query_start_loc", "seq_lens"):
        a, b = getattr(md, name), getattr(md2, name)
        assert torch.equal(a.long(), b) and b.dtype == torch.int64, name
    assert md2.query_start_loc_np is md.query_start_loc_np and md2.max_seq_len == md.max_seq_len == 37
    assert md2.slot_mapping.data_ptr() != md.slot_mapping.data_ptr()   # (a copy, not a view of the host arrays)
