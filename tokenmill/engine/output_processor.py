"""Front-end side of outputs: detokenize, apply stop strings, gather logprobs, and shape RequestOutputs.

A request with n > 1 is n child requests in the engine (ids `i_<request_id>`); this is where they are put
back together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine.detokenizer import IncrementalDetokenizer, find_stop, token_text_cache
from tokenmill.engine.messages import EngineCoreOutput, LogprobsLists
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class ChildState:
    index: int
    request_id: str
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0      # how much text / how many tokens earlier DELTA outputs carried
    sent_tokens: int = 0
    final_sent: bool = False


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    queue: object | None = None   # the server's per-request asyncio queue
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


@dataclass
class IterationStats:
    """Latencies seen while processing outputs, for the metrics: drained by whoever records them."""
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    # (finish reason, e2e latency, queue time, prompt tokens, generated tokens) per finished request
    finished: list[tuple[str, float, float, int, int]] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stats = IterationStats()
        self.token_text = token_text_cache(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, tuple[ParentState, ChildState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, queue: object | None = None) -> list[str]:
        """Track a request; returns the engine-side (child) request ids."""
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = [ChildState(i, child_request_id(request_id, i, params.n),
                               IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                               logprobs=[] if params.logprobs is not None else None,
                               cumulative_logprob=0.0 if params.logprobs is not None else None)
                    for i in range(params.n)]
        parent = ParentState(request_id, prompt, prompt_token_ids, params, children, RequestMetrics(arrival_time),
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None, queue=queue)
        self.parents[request_id] = parent
        for c in children:
            self.children[c.request_id] = (parent, c)
        return [c.request_id for c in children]

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the child ids the engine should abort."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        for c in parent.children:
            self.children.pop(c.request_id, None)
        return [c.request_id for c in parent.children if c.finish_reason is None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def take_stats(self) -> IterationStats:
        stats, self.stats = self.stats, IterationStats()
        return stats

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[tuple[ParentState, RequestOutput]],
                                                                          list[str]]:
        """Returns the outputs to deliver (with their parent) and child ids to abort in the engine
        (stopped by a stop string)."""
        now = time.time()
        updated: dict[str, ParentState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.children.get(out.request_id)
            if entry is None:
                continue
            parent, child = entry
            if self._update_child(parent, child, out, now):
                to_abort.append(child.request_id)
            updated[parent.request_id] = parent
        results = []
        for parent in updated.values():
            ro = self._make_output(parent, now)
            if ro is not None:
                results.append((parent, ro))
            if parent.finished:
                self.abort_request(parent.request_id)
        return results, to_abort

    def _update_child(self, parent: ParentState, child: ChildState, out: EngineCoreOutput, now: float) -> bool:
        m = parent.metrics
        if out.scheduled_time and m.first_scheduled_time is None:
            m.first_scheduled_time = out.scheduled_time
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
                self.stats.ttfts.append(now - m.arrival_time)
            elif m.last_token_time is not None:
                self.stats.itls.append(now - m.last_token_time)
            m.last_token_time = now
        parent.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:
            parent.embedding = out.pooled
        m.engine_seconds += out.engine_seconds
        m.num_output_tokens += len(out.new_token_ids)
        if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None and child.index == 0:
            parent.prompt_logprobs.extend(self._logprob_dicts(out.new_prompt_logprobs))
        params = parent.params
        stopped_by_string = False
        num_before = len(child.token_ids)
        for tok in out.new_token_ids:
            child.token_ids.append(tok)
            skip = tok in params.all_stop_token_ids and not params.include_stop_str_in_output
            delta = "" if skip else child.detokenizer.step(tok)
            child.text += delta
            if params.stop and delta:
                hit = find_stop(child.text, len(delta), params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    child.text = child.text[: hit[1]]
                    child.finish_reason, child.stop_reason = "stop", hit[0]
                    stopped_by_string = True
                    break
        if out.new_logprobs is not None and child.logprobs is not None:
            # a stop string among several tokens (accepted drafts) ends the output there, logprobs included
            kept = len(child.token_ids) - num_before
            dicts = self._logprob_dicts(tuple(part[:kept] for part in out.new_logprobs))
            child.logprobs.extend(dicts)
            child.cumulative_logprob += sum(d[t].logprob for d, t in zip(dicts, out.new_token_ids))
        if not stopped_by_string and out.finish_reason is not None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        if child.finish_reason is not None and parent.finished:
            m.finished_time = now
            queued = (m.first_scheduled_time or m.arrival_time) - m.arrival_time
            generated = sum(len(c.token_ids) for c in parent.children)
            self.stats.finished.append((child.finish_reason, now - m.arrival_time, max(queued, 0.0),
                                        len(parent.prompt_token_ids), generated))
        return stopped_by_string and out.finish_reason is None

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        ids, lps, ranks = lists
        result = []
        for row_ids, row_lps, rank in zip(ids, lps, ranks):
            d = {row_ids[0]: Logprob(row_lps[0], rank, self.token_text(row_ids[0]))}
            for r, (t, lp) in enumerate(zip(row_ids[1:], row_lps[1:]), start=1):
                if t not in d:
                    d[t] = Logprob(lp, r, self.token_text(t))
            result.append(d)
        return result

    def _make_output(self, parent: ParentState, now: float) -> RequestOutput | None:
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        hold = max((len(s) for s in parent.params.stop), default=1) - 1 \
            if not parent.params.include_stop_str_in_output else 0
        completions = []
        for c in parent.children:
            if kind == RequestOutputKind.DELTA:
                # keep back text that may still turn out to start a stop string
                end = len(c.text) if c.finish_reason is not None else max(c.sent_text, len(c.text) - hold)
                text, toks = c.text[c.sent_text:end], c.token_ids[c.sent_tokens:]
                lps = c.logprobs[c.sent_tokens:] if c.logprobs is not None else None
                if not text and not toks and c.finish_reason is None:
                    continue
                if c.final_sent:
                    continue
                c.sent_text, c.sent_tokens = end, len(c.token_ids)
                c.final_sent = c.finish_reason is not None
            else:
                text, toks, lps = c.text, list(c.token_ids), c.logprobs
            completions.append(CompletionOutput(c.index, text, toks, c.cumulative_logprob, lps, c.finish_reason,
                                                c.stop_reason))
        if not completions:
            return None
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions, parent.finished,
                             prompt_logprobs=parent.prompt_logprobs, num_cached_tokens=parent.num_cached_tokens,
                             metrics=parent.metrics, embedding=parent.embedding)
