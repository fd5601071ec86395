"""vLLM's `use_beam_search` for completions and chat: each prompt's search runs as a stream that yields one final
RequestOutput whose outputs are the best `n` beams, so both handlers answer it as they answer sampling."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request

from tokenmill.beam_search import BeamSearch, BeamSearchParams, TopLogprobs, run_beam_search_async, top_of
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.serving_common import ServingContext, merge
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams


def beam_search_params(req, max_tokens: int, width: int | None = None) -> BeamSearchParams | None:
    """The request's beam search, or None when it samples. ValueError naming the field for what cannot combine."""
    if not getattr(req, "use_beam_search", False):
        return None
    if req.temperature not in (None, 0):
        raise ValueError(f"temperature must be 0 (or unset) with use_beam_search, got {req.temperature}")
    for name in ("logprobs", "structured_outputs", "response_format", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar", "tools", "echo"):
        value = getattr(req, name, None)
        if value not in (None, False, [], {}):
            raise ValueError(f"{name} cannot be combined with use_beam_search")
    if req.stop:
        raise ValueError("stop cannot be combined with use_beam_search (stop_token_ids and EOS end a beam)")
    width = width or req.n
    if width < req.n:
        raise ValueError(f"best_of must be at least n ({req.n}) with use_beam_search, got {width}")
    return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                            length_penalty=req.length_penalty,
                            include_stop_str_in_output=req.include_stop_str_in_output)


async def beam_stream(ctx: ServingContext, raw: Request | None, prompt: ProcessedPrompt, params: BeamSearchParams,
                      n: int, request_id: str, priority: int, timeout: float | None,
                      stop_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
    """One prompt's search through the engine: every step admits each running beam as a one-token request with
    logprobs (ServingContext.start, so the server's bounds apply), all at once, then advances the search."""
    engine = ctx.engine
    eos = list(engine.config.model_config.eos_token_ids) + list(stop_token_ids or [])
    search = BeamSearch(prompt.prompt_token_ids, params, eos, ctx.max_model_len)
    steps = 0

    async def score(lists: list[list[int]], counts: list[int]) -> list[TopLogprobs]:
        nonlocal steps
        steps += 1
        subs = [ProcessedPrompt(None, ids, prompt.cache_salt, None, prompt.lora_request) for ids in lists]
        sp = SamplingParams(max_tokens=1, temperature=0, logprobs=max(counts), ignore_eos=True)
        streams = ctx.start(raw, subs, sp, [f"{request_id}-beam{steps}-{j}" for j in range(len(subs))], priority,
                            timeout)
        finals: dict[int, RequestOutput] = {}
        async for i, ro in merge(streams):
            finals[i] = ro
        return [top_of(finals[i].outputs[0].logprobs[0], counts[i]) for i in range(len(subs))]

    await run_beam_search_async([search], score)
    result = search.result(lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True))
    outputs = [CompletionOutput(j, s.text, s.output_token_ids, s.cum_logprob, None, s.finish_reason, s.stop_reason)
               for j, s in enumerate(result.sequences[:n])]
    yield RequestOutput(request_id, prompt.prompt, prompt.prompt_token_ids, outputs, True)
