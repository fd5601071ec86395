"""OpenAI request and response bodies (pydantic), with vLLM's extra sampling fields."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.structured_output.grammar_text import validate as validate_grammar
from tokenmill.structured_output.params import StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat; unknown fields are accepted and ignored, as OpenAI does."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None   # only requests with the same salt share cached prefix blocks (tenants)
    kv_transfer_params: dict[str, Any] | None = None   # disaggregated serving: {"remote_address": tcp://...}
    timeout: float | None = None    # seconds; past it the request is aborted and answered with a 408 error
    use_beam_search: bool = False   # vLLM's: n beams (best_of in completions, if larger) by transformers' rules
    length_penalty: float = 1.0     # beam search: a hypothesis scores cum_logprob / generated_len ** length_penalty

    def checked_timeout(self) -> float | None:
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")
        return self.timeout
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for, checked (ValueError naming the field)."""
        given = []
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, dict):
                raise ValueError("structured_outputs must be an object")
            fields = {k: v for k, v in self.structured_outputs.items()
                      if k in StructuredOutputsParams.__dataclass_fields__ and k != "grammar_text"}
            unknown = set(self.structured_outputs) - set(fields) - {"backend", "whitespace_pattern"}
            if unknown:
                raise ValueError(f"structured_outputs has unknown key(s) {sorted(unknown)}")
            given.append(("structured_outputs", fields))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        rf = self._response_format()
        if rf is not None:
            given.append(rf)
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"structured_outputs must be one constraint, not {[g[0] for g in given]}")
        field_name, fields = given[0]
        try:
            params = StructuredOutputsParams(**fields)
        except TypeError as e:
            raise ValueError(f"{field_name} is malformed: {e}") from e
        if field_name == "structured_outputs":
            field_name = f"structured_outputs.{params.kind}"
        return validate_grammar(params, field_name)

    def _response_format(self) -> tuple[str, dict] | None:
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return "response_format", {"json_object": True}
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object with a 'schema' object")
            return "response_format.json_schema.schema", {"json": js.get("schema") or {"type": "object"}}
        if kind == "structural_tag":
            return "response_format", {"structural_tag": {k: v for k, v in rf.items() if k != "type"}}
        raise ValueError("response_format.type must be one of text, json_object, json_schema, structural_tag, "
                         f"got {kind!r}")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                         default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias, structured_outputs=self.structured_outputs_params(),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs, default_max_tokens)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, None,
                                     default_max_tokens)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def now() -> int:
    return int(time.time())


