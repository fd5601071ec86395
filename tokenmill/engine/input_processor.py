"""Front-end side of inputs: tokenize, render chat templates, validate, and make EngineCoreRequests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tokenmill.config import MediaOptions, ModelConfig, MultiModalConfig
from tokenmill.engine.engine_core import validate_prompt_length
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.kv_transfer.config import check_kv_transfer_params
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    cache_salt: str | None = None   # vLLM's field: only requests with the same salt share cached prefix blocks
    kv_transfer_params: dict | None = None   # vLLM's field: where a prefill instance holds this prompt's KV
    lora_request: LoRARequest | None = None   # the adapter the request runs with
    mm_features: list[MultiModalFeature] | None = None   # its images (a vision model), in prompt order


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer, mm_config: MultiModalConfig | None = None,
                 media: MediaOptions | None = None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.vocab_size = int(model_config.hf_config.vocab_size)
        self.media = media or MediaOptions()
        self.mm = None   # a vision model's MultiModalProcessor (its image preprocessing and placeholders)
        if mm_config is not None:
            from tokenmill.multimodal.processing import MultiModalProcessor, image_inputs_for

            images = image_inputs_for(model_config.model, model_config.mm_hf_config, tokenizer,
                                      mm_config.processor_kwargs)
            self.mm = MultiModalProcessor(images, mm_config.limit_per_prompt, self.media)
        elif getattr(model_config.hf_config, "is_encoder_decoder", False):
            from tokenmill.multimodal.speech import AudioProcessor

            self.mm = AudioProcessor(model_config, self.media)

    def process_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> ProcessedPrompt:
        """A string, {"prompt": str}, {"prompt_token_ids": [...]} (vLLM's form) or a list of token ids."""
        processed = self._process_prompt(prompt, getattr(self.mm, "add_special_tokens", add_special_tokens))
        if getattr(self.mm, "requires_media", False) and not processed.mm_features:
            raise ValueError(f"model {self.model_config.served_model_name!r} is a speech model: a prompt needs its "
                             "audio (multi_modal_data {'audio': ...}, or /v1/audio/transcriptions)")
        return processed

    def _process_prompt(self, prompt: PromptType, add_special_tokens: bool) -> ProcessedPrompt:
        if isinstance(prompt, dict):
            salt = check_cache_salt(prompt.get("cache_salt"))
            mm_data = prompt.get("multi_modal_data")
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                processed = self._checked(prompt.get("prompt"), ids) if mm_data is None else \
                    self._with_media(prompt.get("prompt"), ids, mm_data)
            elif mm_data is not None and not prompt.get("prompt"):   # (a speech model's default prompt)
                processed = self._with_media(None, [], mm_data)
            elif "prompt" in prompt:
                processed = self._process_prompt(prompt["prompt"], add_special_tokens)
                if mm_data is not None:
                    processed = self._with_media(processed.prompt, processed.prompt_token_ids, mm_data)
            else:
                raise ValueError("prompt dict needs a 'prompt' or 'prompt_token_ids' key")
            processed.cache_salt = salt
            processed.kv_transfer_params = check_kv_transfer_params(prompt.get("kv_transfer_params"))
            return processed
        if isinstance(prompt, (list, tuple)):
            return self._checked(None, list(prompt))
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty")
        try:
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        except Exception as e:  # noqa: BLE001 - e.g. a lone UTF-16 surrogate, which the tokenizer cannot encode
            raise ValueError(f"prompt could not be tokenized: {type(e).__name__}: {e}") from e
        return self._checked(prompt, ids)

    def _with_media(self, text: str | None, ids: list[int], mm_data) -> ProcessedPrompt:
        """A prompt with its media: each image placeholder expanded to the image's embeddings, or a speech
        model's audio window."""
        if self.mm is None:
            raise ValueError(f"multi_modal_data: model {self.model_config.served_model_name!r} takes no images "
                             "(it has no vision tower)")
        mm = self.mm.apply(ids, mm_data)
        processed = self._checked(text, mm.token_ids)
        processed.mm_features = mm.features or None
        return processed

    def _checked(self, text: str | None, ids: list[int]) -> ProcessedPrompt:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be integers")
        validate_prompt_length(len(ids), self.model_config.max_model_len)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids has token id(s) {bad[:5]} outside the vocabulary of {self.vocab_size}")
        return ProcessedPrompt(text, ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("each message must be an object with a 'role'")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model has no chat template; pass chat_template")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault: jinja raises many types
            raise ValueError(f"messages could not be rendered by the chat template: {type(e).__name__}: {e}") from e

    def make_request(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams,
                     arrival_time: float | None = None, priority: int = 0) -> EngineCoreRequest:
        params.update_from_model(self.model_config.eos_token_ids, self.vocab_size)
        if params.structured_outputs is not None and not params.structured_outputs.grammar_text:
            from tokenmill.structured_output.grammar_text import validate

            validate(params.structured_outputs)
        return EngineCoreRequest(request_id, processed.prompt_token_ids, params,
                                 arrival_time if arrival_time is not None else time.time(), priority,
                                 processed.cache_salt, kv_transfer_params=processed.kv_transfer_params,
                                 lora_request=processed.lora_request, mm_features=processed.mm_features)


def check_cache_salt(salt) -> str | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt must be a non-empty string")
    return salt


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The SamplingParams of child `index` of an n > 1 request: one completion each, distinct seeds."""
    if params.n == 1:
        return params
    seed = params.seed + index if params.seed is not None else None
    child = params.clone(n=1, seed=seed)
    child.all_stop_token_ids = set(params.all_stop_token_ids)
    return child
