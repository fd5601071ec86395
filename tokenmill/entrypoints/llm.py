"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tokenmill.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, TopLogprobs, run_beam_search, top_of
from tokenmill.config import EngineArgs
from tokenmill.engine.create_config import create_engine_config
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, PromptType, child_params
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import RequestStatus
from tokenmill.entrypoints.scoring import (
    ScoringOutput,
    ScoringRequestOutput,
    cosine,
    cross_encoder_score,
    pair_token_ids,
    score_pairs,
)
from tokenmill.lora.request import LoRARequest, check_lora_request
from tokenmill.model.tokenizer import load_tokenizer
from tokenmill.multimodal.chat_parts import load_images, template_messages
from tokenmill.multimodal.transcription import Transcript
from tokenmill.outputs import EmbeddingOutput, PoolingRequestOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.metrics import SpecDecodingTotals


class LLM:
    """Runs the real engine core in-process: continuous batching, paged KV cache, prefix caching."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.config = create_engine_config(self.engine_args)
        self.tokenizer = load_tokenizer(self.config.model_config.tokenizer)
        self.engine_core = EngineCore(self.config)
        self.input_processor = InputProcessor(self.config.model_config, self.tokenizer, self.config.mm_config,
                                              self.config.media)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        self.spec_decoding_stats = SpecDecodingTotals()   # acceptance over every generate/chat call

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stops the engine's worker ranks (tensor or pipeline parallel); the in-process engine needs nothing."""
        self.engine_core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None, the base model) per prompt."""
        prompts = prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        # Validate everything before anything runs: a bad prompt must not leave half a batch behind.
        self._check_generative()
        processed = [self.input_processor.process_prompt(p) for p in prompts]
        _set_loras(processed, lora_request)
        return self._run(processed, params, priority, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's offline beam search, with transformers' rules (`tokenmill/beam_search.py`): every step scores
        all running beams of all prompts as one batch of one-token requests, whose shared history the prefix cache
        serves."""
        prompts = prompt_list(prompts)
        self._check_generative()
        processed = [self.input_processor.process_prompt(p) for p in prompts]
        mc = self.config.model_config
        searches = [BeamSearch(p.prompt_token_ids, params, mc.eos_token_ids, self.config.scheduler_config.max_model_len)
                    for p in processed]
        run_beam_search(searches, lambda lists, counts: self._top_logprobs(lists, counts, lora_request))
        return [s.result(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)) for s in searches]

    def _top_logprobs(self, lists: list[list[int]], counts: list[int],
                      lora_request: LoRARequest | None) -> list[TopLogprobs]:
        params = [SamplingParams(max_tokens=1, temperature=0, logprobs=n, ignore_eos=True)
                  for n in counts]
        outs = self.generate([{"prompt_token_ids": ids} for ids in lists], params, use_tqdm=False,
                             lora_request=lora_request)
        return [top_of(o.outputs[0].logprobs[0], n) for o, n in zip(outs, counts)]

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
              normalize: bool = True) -> list[PoolingRequestOutput]:
        """One embedding per prompt: its final hidden states pooled as --pooler says (prefill only, through the same
        scheduler as generation; its KV blocks are freed after)."""
        pooler = self.config.pooler
        if pooler is None:
            raise ValueError("embed: this LLM was made without pooling; pass pooler='last', 'mean' or 'cls'")
        prompts = prompt_list(prompts)
        outs = self._pooled(prompts, normalize, use_tqdm)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding)) for o in outs]

    def _pooled(self, prompts: list, normalize: bool, use_tqdm: bool) -> list[RequestOutput]:
        processed = [self.input_processor.process_prompt(p) for p in prompts]
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, pooling=self.config.pooler,
                                normalize=normalize)
        return self._run(processed, [params] * len(processed), None, use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: a cross-encoder scores each pair as one prompt (the sigmoid of its logit); an
        embedding model (pooler=...) gives the cosine of the two texts' embeddings."""
        pairs = score_pairs(text_1, text_2)
        if self.config.model_config.num_labels:
            prompts = [{"prompt_token_ids": pair_token_ids(self.tokenizer, a, b)} for a, b in pairs]
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(cross_encoder_score(
                o.embedding))) for o in self._pooled(prompts, False, use_tqdm)]
        if self.config.pooler is None:
            raise ValueError("score: this model is neither a cross-encoder (*ForSequenceClassification) nor served "
                             "with a pooler (pooler='last', 'mean' or 'cls' gives cosine scores of embeddings)")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vecs = dict(zip(texts, (o.embedding for o in self._pooled(texts, True, use_tqdm))))
        return [ScoringRequestOutput(str(i), [], ScoringOutput(cosine(vecs[a], vecs[b])))
                for i, (a, b) in enumerate(pairs)]

    def _check_generative(self) -> None:
        if self.config.model_config.num_labels:
            raise ValueError("this model is a cross-encoder (*ForSequenceClassification): it scores pairs "
                             "(LLM.score) and does not generate")

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        self._check_generative()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ip = self.input_processor
        processed = []
        for c in conversations:
            parts, images = template_messages(c, ip.mm is not None)   # image_url / image_pil parts
            text = ip.apply_chat_template(parts, add_generation_prompt, chat_template, **template_kwargs)
            prompt = {"prompt": text, "multi_modal_data": {"image": load_images(images, self.config.media)}} \
                if images else text
            # the template already holds the special tokens: do not add a BOS again
            processed.append(ip.process_prompt(prompt, add_special_tokens=False))
        _set_loras(processed, lora_request)
        return self._run(processed, _params_per_prompt(sampling_params, len(processed)), None, use_tqdm)

    def transcribe(self, audio, language: str | None = None, task: str = "transcribe", prompt: str | None = None,
                   temperature: float = 0.0, timestamps: bool = True, use_tqdm: bool = False) -> Transcript:
        """A speech model's transcript of a clip of any length ((samples, sample_rate), samples at 16 kHz, or a
        file's bytes or path): its windows of at most 30 s run as one batch and are joined, with segment times
        (timestamps=True) as /v1/audio/transcriptions gives them in verbose_json."""
        from pathlib import Path

        from tokenmill.engine.input_processor import ProcessedPrompt
        from tokenmill.multimodal.audio import SAMPLE_RATE, check_duration, checked_audio, decode_audio
        from tokenmill.multimodal.speech import AudioProcessor
        from tokenmill.multimodal.transcription import TranscriptionOptions, join, window_segments

        speech = self.input_processor.mm
        if not isinstance(speech, AudioProcessor):
            raise ValueError("transcribe: the model is not a speech model (it takes no audio)")
        if isinstance(audio, (str, Path, bytes)):
            samples = decode_audio(audio if isinstance(audio, bytes) else Path(audio).read_bytes(), "audio")
            check_duration(samples, speech.max_seconds, "audio")
        else:
            samples = checked_audio(audio, speech.max_seconds, "audio")
        opts = TranscriptionOptions(task, language, prompt, temperature, "verbose_json" if timestamps else "json")
        opts.check()
        if speech.needs_detection(opts):
            ids, feature = speech.detection_request(samples)
            found = self._run([ProcessedPrompt(None, ids, mm_features=[feature])],
                              [SamplingParams(temperature=0, max_tokens=1)], None, False)
            opts = dataclasses.replace(opts, language=speech.language_of(found[0].outputs[0].token_ids[0]))
        windows = speech.windows(samples, opts, self.tokenizer)
        room = self.config.scheduler_config.max_model_len - max(len(ids) for _, ids, _ in windows)
        params = SamplingParams(temperature=temperature, max_tokens=max(1, room))
        outs = self._run([ProcessedPrompt(None, ids, mm_features=[f]) for _, ids, f in windows],
                         [params] * len(windows), None, use_tqdm)
        segments = [window_segments(o.outputs[0].token_ids, w, speech.tokens, self.tokenizer.decode)
                    for o, (w, _, _) in zip(outs, windows)]
        return join(segments, len(samples) / SAMPLE_RATE, opts, speech.tokens)

    def _run(self, processed, params, priority, use_tqdm: bool) -> list[RequestOutput]:
        ids = []
        for i, (p, sp) in enumerate(zip(processed, params)):
            rid = str(next(self._counter))
            now = time.time()
            child_ids = self.output_processor.add_request(rid, p.prompt, p.prompt_token_ids, sp, now)
            for index, cid in enumerate(child_ids):
                req = self.input_processor.make_request(cid, p, child_params(sp, index), now,
                                                        priority[i] if priority else 0)
                self.engine_core.add_request(req)
            ids.append(rid)
        return self._run_engine(ids, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        in_toks = out_toks = 0
        start = time.perf_counter()
        try:
            while self.engine_core.has_unfinished_requests():
                step = self.engine_core.step()
                if step.errors:   # a grammar that failed to compile (rare: the front end checked it)
                    rid, message = next(iter(step.errors.items()))
                    raise ValueError(f"request {rid}: {message}")
                outputs = step.outputs
                if step.scheduler_stats is not None:
                    self.spec_decoding_stats.add(step.scheduler_stats)
                with self.engine_core.profile.phase("output_processing"):
                    done, to_abort = self.output_processor.process_outputs(outputs)
                if to_abort:
                    self.engine_core.abort_requests(to_abort, RequestStatus.FINISHED_STOPPED)
                for _, ro in done:
                    if ro.finished:
                        results[ro.request_id] = ro
                        if bar is not None:
                            in_toks += len(ro.prompt_token_ids)
                            out_toks += sum(len(c.token_ids) for c in ro.outputs)
                            elapsed = time.perf_counter() - start
                            bar.set_postfix_str(f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                                                f"output: {out_toks / elapsed:.2f} toks/s")
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine_core.abort_requests(self.output_processor.abort_request(rid))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]


def prompt_list(prompts) -> list:
    """One prompt (a string, a prompt dict or a list of token ids) or several, as a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _params_per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                       n: int) -> list[SamplingParams]:
    """One SamplingParams for all prompts, or one each (vLLM's generate and chat take both)."""
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        return list(sampling_params)
    return [sampling_params or SamplingParams()] * n


def _set_loras(processed: list, lora_request) -> None:
    loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(processed)
    if len(loras) != len(processed):
        raise ValueError(f"got {len(loras)} lora_requests for {len(processed)} prompts")
    for p, lora in zip(processed, loras):
        p.lora_request = check_lora_request(lora)


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
