"""M-RoPE (Qwen2-VL): a prompt token's rotary position is a (t, h, w) triple. Text tokens count on from the
last position (all three equal); an image's tokens take (start, start + row, start + column) over its merged
grid, and the text after it starts at start + max(rows, columns). Past the prompt every position is its index
plus the prompt's delta (the last position + 1 minus its length).

The engine's rotary table stays one-dimensional: a token whose three positions are equal reads its usual row,
and each token that differs gets a row of its own, written for the step into the table's spare rows. Every
attention path (the native stack's included) then applies M-RoPE by looking rows up as it always does."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.multimodal.inputs import MultiModalFeature


def mrope_positions(num_prompt_tokens: int, features: list[MultiModalFeature],
                    merge: int) -> tuple[np.ndarray, int]:
    """The prompt's [3, num_prompt_tokens] positions and its delta."""
    pos = np.empty((3, num_prompt_tokens), dtype=np.int64)
    cur = prev = 0
    for f in sorted(features, key=lambda f: f.offset):
        pos[:, prev:f.offset] = cur + np.arange(f.offset - prev)
        cur += f.offset - prev
        t, h, w = (int(x) for x in f.data["image_grid_thw"].numpy().reshape(3))
        h, w = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[:, f.offset:f.end] = cur + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        cur += max(h, w)
        prev = f.end
    pos[:, prev:] = cur + np.arange(num_prompt_tokens - prev)
    return pos, int(pos.max()) + 1 - num_prompt_tokens if num_prompt_tokens else 0


class MRopeRows:
    """Spare rows past the rotary table's positions, filled each step for the tokens whose positions differ."""

    def __init__(self, rotary, inv_freq: torch.Tensor, section: list[int], spare: int):
        self.rotary, self.first = rotary, rotary.cos.shape[0]
        self.spare = spare
        half = inv_freq.shape[0]
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} must add up to head_dim / 2 = {half}")
        self.inv_freq = inv_freq.float()
        self.axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))   # which of t/h/w each freq reads
        pad = torch.zeros(spare, rotary.cos.shape[1], dtype=rotary.cos.dtype, device=rotary.cos.device)
        rotary.cos = torch.cat([rotary.cos, pad])
        rotary.sin = torch.cat([rotary.sin, pad.clone()])

    def rows_for(self, triples: np.ndarray) -> np.ndarray:
        """Table rows for [3, k] positions: written into the spare rows (valid for this step)."""
        k = triples.shape[1]
        if k > self.spare:
            raise ValueError(f"a step has {k} image positions, more than the rotary table's {self.spare} spare rows")
        pos = torch.from_numpy(triples).float()[self.axis]          # [half, k]: each frequency's own axis
        freqs = (pos * self.inv_freq[:, None]).T                    # [k, half]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rotary.cos[self.first:self.first + k] = emb.cos().to(self.rotary.cos.dtype)
        self.rotary.sin[self.first:self.first + k] = emb.sin().to(self.rotary.sin.dtype)
        return self.first + np.arange(k)

    def remap(self, positions: torch.Tensor, states, start: np.ndarray, n: np.ndarray, query_start: np.ndarray,
              merge: int) -> None:
        """The step's flat positions (token indices) made M-RoPE's: in place, for the requests with images."""
        differing: list[tuple[int, np.ndarray, np.ndarray]] = []   # (first flat row, its rows, their triples)
        for r, state in enumerate(states):
            if not state.mm_features:
                continue
            if state.mrope is None:
                state.mrope = mrope_positions(state.num_prompt_tokens, state.mm_features, merge)
            table, delta = state.mrope
            idx = np.arange(int(start[r]), int(start[r] + n[r]))
            out = idx + delta
            inside = idx < table.shape[1]
            triples = table[:, idx[inside]]
            out[inside] = triples[0]
            same = (triples[0] == triples[1]) & (triples[1] == triples[2])
            rows = np.nonzero(inside)[0][~same]
            if len(rows):
                differing.append((int(query_start[r]), rows, triples[:, ~same]))
            positions[int(query_start[r]):int(query_start[r + 1])] = torch.from_numpy(out)
        if differing:
            virtual = self.rows_for(np.concatenate([t for _, _, t in differing], axis=1))
            k = 0
            for base, rows, _ in differing:
                positions[torch.from_numpy(base + rows)] = torch.from_numpy(virtual[k:k + len(rows)])
                k += len(rows)
