"""Engine results -> RequestOutput: detokenisation, stop strings, logprobs, n-sample grouping."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.outputs import RunnerOutput
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.request import Request, RequestStatus


@dataclass
class _Sample:
    request: Request
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return self.detok.output_text if self.detok else ""


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self._group_of: dict[str, _Group] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], requests: list[Request]):
        wants_text = self.tokenizer is not None
        samples = [_Sample(r, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, r.params) if wants_text
                           else None, logprobs=[] if r.params.logprobs is not None else None,
                           cumulative_logprob=0.0 if r.params.logprobs is not None else None) for r in requests]
        prompt_lp = [None] if requests[0].params.prompt_logprobs is not None else None
        group = _Group(request_id, prompt, list(prompt_token_ids), samples, prompt_lp)
        self.groups[request_id] = group
        for s in samples:
            self._group_of[s.request.request_id] = group

    def process(self, touched: list[Request], result: RunnerOutput,
                finish: Callable[[str, RequestStatus], object]) -> list[RequestOutput]:
        """Fold one step into the groups; `finish` ends requests whose stop string matched."""
        changed: dict[str, _Group] = {}
        for req in touched:
            group = self._group_of.get(req.request_id)
            if group is None:
                continue
            sample = next(s for s in group.samples if s.request is req)
            self._update_sample(sample, result, finish)
            self._update_prompt_logprobs(group, result.prompt_logprobs.get(req.request_id))
            changed[group.request_id] = group
        outputs = [self._output(g) for g in changed.values()]
        for g in changed.values():
            if g.finished:
                self._drop(g)
        return outputs

    def _update_sample(self, sample: _Sample, result: RunnerOutput, finish) -> None:
        req = sample.request
        if sample.finish_reason is not None:
            return
        new = req.output_token_ids[len(sample.token_ids):]
        if new and req.request_id in result.logprobs:
            self._append_logprobs(sample, result.logprobs[req.request_id])
        if sample.detok is not None:
            stop = sample.detok.append(new)
            new = sample.detok.output_token_ids[len(sample.token_ids):]
            if stop is not None and not req.is_finished:
                finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop
        sample.token_ids.extend(new)
        if req.is_finished:
            sample.finish_reason = req.status.value
            sample.stop_reason = req.stop_reason

    def _append_logprobs(self, sample: _Sample, entry: tuple[list[int], list[float], int]) -> None:
        ids, lps, rank = entry
        sample.logprobs.append(self._logprob_dict(ids, lps, rank))
        sample.cumulative_logprob += lps[0]

    def _logprob_dict(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        """Column 0 is the chosen token (with its true rank), then the top-k by rank."""
        top = {tid: Logprob(lp, i, self._piece(tid)) for i, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), 1)}
        top[ids[0]] = Logprob(lps[0], rank, self._piece(ids[0]))
        return top

    def _update_prompt_logprobs(self, group: _Group, chunk) -> None:
        if chunk is None or group.prompt_logprobs is None:
            return
        ids, lps, ranks = (t.tolist() for t in chunk)
        for row_ids, row_lps, rank in zip(ids, lps, ranks):
            group.prompt_logprobs.append(self._logprob_dict(row_ids, row_lps, rank))

    def _piece(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None

    def _output(self, group: _Group) -> RequestOutput:
        outs = [CompletionOutput(s.request.sample_index, s.text, list(s.token_ids), s.cumulative_logprob,
                                 s.logprobs, s.finish_reason, s.stop_reason) for s in group.samples]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, group.finished,
                             group.prompt_logprobs)

    def _drop(self, group: _Group) -> None:
        self.groups.pop(group.request_id, None)
        for s in group.samples:
            self._group_of.pop(s.request.request_id, None)

    def abort(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is not None:
            self._drop(group)
