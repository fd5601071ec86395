"""Cross-encoders of the Llama family (`LlamaForSequenceClassification`, Qwen2's, Qwen3's, Mistral's): the same
decoder, and a `score` head (hidden -> num_labels, no bias) read at the prompt's last token, as transformers does
for an unpadded prompt. The runner's pooling gives that token's hidden state to `pooled_output`."""

from __future__ import annotations

import torch

from tokenmill.layers.linear import Linear
from tokenmill.model.llama import LlamaForCausalLM, load_stacked_weights


class LlamaForSequenceClassification(LlamaForCausalLM):
    def __init__(self, cfg, backend, max_positions: int):
        super().__init__(cfg, backend, max_positions)
        self.tied = False
        self.lm_head = None
        self.score = Linear(cfg.hidden_size, int(cfg.num_labels))

    def _make_logits_head(self):
        return self.score.kernel

    def attach_quant_method(self, method) -> None:
        """The decoder's layers take `method`; the small score head stays unquantized."""
        score_method = self.score.quant_method
        super().attach_quant_method(method)
        self.score.quant_method = score_method

    def pooled_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The label logits of one pooled hidden state [hidden] -> [num_labels], in fp32."""
        return self.logits_head(hidden[None])[0].float()

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        load_stacked_weights(params, ((n, t) for n, t in weights if self._owns(n)))
