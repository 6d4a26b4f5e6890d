"""Turns a SchedulerOutput into tensors, runs the model, samples. Owns the cache tensors."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from deepinfer.engine.kv_cache import ForkCopy
from deepinfer.engine.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from deepinfer.layers.batch_invariant import batch_invariant, forward_per_token, position_seed
from deepinfer.layers.metadata import CacheTensorSpec, ForwardMeta, host_long, sub_meta
from deepinfer.spec.base import ProposeBatch, ProposeItem, Proposer
from deepinfer.worker.encoder_cache import EncoderCache
from deepinfer.worker.host_memory import keep_freed_memory
from deepinfer.worker.rejection import verify_greedy, verify_random
from deepinfer.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    compute_prompt_logprobs,
    make_generator,
    plain_greedy,
)
from deepinfer.worker.threads import StepThreads

logger = logging.getLogger("deepinfer")


@dataclass(frozen=True)
class CacheLayout:
    """How the memory budget was split, reported at start-up."""

    num_blocks: int
    block_size: int
    num_state_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    num_snapshot_slots: int = 0  # extra state rows for prefix-cache snapshots of bounded state

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def state_rows(self) -> int:
        return self.num_state_slots + self.num_snapshot_slots

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def describe(self) -> str:
        total = self.num_blocks * self.bytes_per_block + self.state_rows * self.bytes_per_slot
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
                f"({self.bytes_per_token:.0f} B/token), {self.num_state_slots} state slots "
                f"({self.bytes_per_slot / 2**20:.2f} MiB each) + {self.num_snapshot_slots} prefix snapshots, "
                f"{total / 2**20:.1f} MiB in all")


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_cache(specs: list[CacheTensorSpec], block_size: int, num_slots: int, budget_bytes: int,
               max_useful_blocks: int, num_snapshots: int = 0) -> CacheLayout:
    """Reserve state slots (and snapshot rows) first, then as many blocks as the budget allows (capped at
    what can be used)."""
    per_block = sum(s.bytes_per_unit for s in specs if s.kind == "paged")
    per_slot = sum(s.bytes_per_unit for s in specs if s.kind == "state")
    left = budget_bytes - (num_slots + num_snapshots) * per_slot
    num_blocks = min(left // per_block, max_useful_blocks) if per_block else max_useful_blocks
    if num_blocks < 1:
        need = num_slots * per_slot + per_block
        raise ValueError(f"KV cache budget of {budget_bytes} bytes is too small: {num_slots} state slots "
                         f"and one block need {need} bytes; lower max_num_seqs or raise kv_cache_memory_bytes")
    return CacheLayout(int(num_blocks), block_size, num_slots, per_block, per_slot, num_snapshots)


def _every_row(rows: list[int], n: int) -> bool:
    """Whether rows is 0, 1, ..., n - 1: selecting them from n rows would copy the tensor as it is."""
    return len(rows) == n and rows == list(range(n))


def _rows(hidden: torch.Tensor, indices: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[indices], where `rows` holds the same indices on the host: hidden itself for every row in order (a
    decode step samples each), saving an index op per step."""
    return hidden if _every_row(rows, hidden.shape[0]) else hidden[indices]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: CacheLayout, device: torch.device,
                 deterministic: bool = False, seed: int = 0, proposer: Proposer | None = None,
                 specs: list[CacheTensorSpec] | None = None, scratch_rows: int = 0):
        """scratch_rows: extra paged blocks and state rows past the layout's, never handed out by the scheduler
        (CUDA graphs' padding rows write there: block layout.num_blocks, state row layout.state_rows)."""
        self.model, self.layout, self.device = model, layout, device
        if device.type == "cpu":
            keep_freed_memory()  # step buffers reused, not re-faulted (host_memory.py)
        self.scratch_rows = scratch_rows
        self.graphs = None  # worker.cuda_graphs.StepGraphs once captured
        self.deterministic, self.seed = deterministic, seed
        self.proposer = proposer
        self.vocab_size = model.config.vocab_size
        self.eos_token_ids = model.config.eos_token_ids
        self.specs = specs if specs is not None else model.kv_cache_spec(layout.block_size)
        self.cache = {s.name: self._allocate(s) for s in self.specs}
        model.bind_kv_cache(self.cache)
        self.sampler = Sampler()
        self.threads = StepThreads() if device.type == "cpu" and not deterministic else None
        # a vision model's encoder outputs by image digest (image spans of prompts)
        self.encoder = EncoderCache(model.encode_image) if getattr(model, "vision", None) is not None else None
        # The plain forward, `model(meta)`; two-batch overlap swaps in distributed.overlap.TwoBatchForward.
        self.forward = model
        # Tokens sampled by the previous execute: async scheduling's placeholders resolve from here.
        self.last_sampled: dict[str, int] = {}

    def _allocate(self, spec: CacheTensorSpec) -> torch.Tensor:
        rows = (self.layout.num_blocks if spec.kind == "paged" else self.layout.state_rows) + self.scratch_rows
        return torch.zeros((rows, *spec.shape), dtype=spec.dtype, device=self.device)

    # --- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        meta, sample_rows, prompt_rows = self._prepare(out.scheduled)
        if self.threads is not None:
            self.threads.apply(meta.num_tokens)
        self._copy_state(out.restores)  # a prefix hit's bounded state, before it is read
        logits, draft_input = self._logits(meta, [row for _, row in sample_rows] + [row for _, _, row in prompt_rows])
        result = RunnerOutput()
        self._sample(out, logits, sample_rows, result)
        self._prompt_logprobs(logits, prompt_rows, result)
        if self.proposer is not None and out.propose_drafts:  # before copies: draft state is part of the step
            self._propose(out, meta, draft_input, result)
        self._copy_state(out.snapshots)  # bounded state at a block boundary, after it is written
        self._apply_forks(out.forks)
        self.last_sampled = result.sampled
        return result

    def _logits(self, meta: ForwardMeta, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of `rows`, and the target state the proposer drafts from (if it needs any)."""
        if self.deterministic:  # never with speculation (EngineArgs rejects the combination)
            if not getattr(self.model, "batch_invariant_kernels", False):
                return forward_per_token(self.model, meta, rows), None
            with batch_invariant():
                return self.model.compute_logits(self.model(meta)[meta.logits_indices]), None
        kind = self.proposer.hidden_kind if self.proposer is not None else ""
        if self._graphed(meta):
            out = self.graphs.run(meta)
            hidden, draft_input = out[0], (out[1] if kind == "mtp" else out[0] if kind == "final" else None)
        elif kind != "mtp" and (decodes := self._graphed_decodes(meta)) is not None:
            rest = sub_meta(meta, decodes.num_reqs, meta.num_reqs)
            hidden = torch.cat([self.graphs.run(decodes)[0], self.model(rest)])
            draft_input = hidden if kind == "final" else None
        elif kind == "mtp":
            hidden, draft_input = self.model(meta, return_mtp_input=True)
        else:
            hidden = self.forward(meta)
            draft_input = hidden if kind == "final" else None
        return self.model.compute_logits(_rows(hidden, meta.logits_indices, rows)), draft_input

    def _graphed(self, meta: ForwardMeta) -> bool:
        """Whether this step replays a CUDA graph (decode / verify steps they cover; never two-batch overlap)."""
        return (self.graphs is not None and self.forward is self.model
                and self.graphs.covers(meta))

    def _graphed_decodes(self, meta: ForwardMeta) -> ForwardMeta | None:
        """In a mixed step, its leading one-token decodes as a batch of their own when the graphs cover it: they
        replay (compiled / captured) and only the rest (prefill chunks) runs eagerly, instead of the whole
        step. Requests are independent in attention and row order is kept, so the hidden rows are the same."""
        if self.graphs is None or self.forward is not self.model or meta.num_reqs < 2:
            return None
        lens = meta.query_lens()
        r = next((i for i, n in enumerate(lens) if n != 1), len(lens))
        if not 0 < r < len(lens):
            return None
        width = -(-max(meta.seq_lens[:r]) // meta.block_size)  # the decodes' own blocks, not the prefills'
        decodes = sub_meta(meta, 0, r)
        decodes = dataclasses.replace(decodes, block_table=decodes.block_table[:, :width])
        return decodes if self.graphs.covers(decodes) else None

    def _prepare(self, scheduled: list[ScheduledRequest]):
        ids, positions, token_req, qstart = [], [], [], [0]
        sample_rows, prompt_rows = [], []
        for r, s in enumerate(scheduled):
            ids += self._input_ids(s)
            positions += range(s.start, s.start + s.num_new_tokens)
            token_req += [r] * s.num_new_tokens
            qstart.append(qstart[-1] + s.num_new_tokens)
            if s.samples:  # the last real token's row and one row per draft
                sample_rows += [(s.request, row) for row in range(qstart[-1] - 1 - s.num_drafts, qstart[-1])]
            prompt_rows += self._prompt_logprob_rows(s, qstart[-2])
        meta = ForwardMeta(
            input_ids=self._long(ids), positions=self._long(positions), token_req=self._long(token_req),
            block_table=self._block_table(scheduled), state_slots=self._long([s.state_slot for s in scheduled]),
            logits_indices=self._long([row for _, row in sample_rows] + [row for _, _, row in prompt_rows]),
            query_start=qstart, seq_starts=[s.start for s in scheduled],
            seq_lens=[s.start + s.num_new_tokens for s in scheduled], block_size=self.layout.block_size,
            paged_write_from=[s.write_from for s in scheduled],
            prompt_lens=[len(s.request.prompt_token_ids) for s in scheduled], images=self._images(scheduled, qstart))
        return meta, sample_rows, prompt_rows

    def _images(self, scheduled: list[ScheduledRequest], qstart: list[int]):
        """The step's image-span rows (encoding images not cached yet); None for a text-only step."""
        chunks = [(s.request.images, qstart[r], s.start, s.start + s.num_new_tokens - s.num_drafts)
                  for r, s in enumerate(scheduled) if s.request.images and s.start < s.request.images[-1].end]
        return self.encoder.step_rows(chunks, self.device) if chunks and self.encoder is not None else None

    def _input_ids(self, s: ScheduledRequest) -> list[int]:
        """The step's input tokens (then its drafts); a placeholder is the token this request sampled in the
        previous step (async scheduling, which never carries drafts)."""
        end = s.start + s.num_new_tokens - s.num_drafts
        if not s.placeholder:
            return s.request.token_ids(s.start, end) + s.draft_token_ids
        return s.request.token_ids(s.start, end - 1) + [self.last_sampled[s.request.request_id]]

    def _outputs(self, s: ScheduledRequest) -> list[int]:
        """Output tokens before the one sampled now (the request's list may still be catching up)."""
        known = s.request.output_token_ids[:s.num_outputs]
        return known + [self.last_sampled[s.request.request_id]] if s.placeholder else known

    @staticmethod
    def _prompt_logprob_rows(s: ScheduledRequest, first_row: int) -> list[tuple]:
        """(request, target token, row) for prompt positions whose next token is a prompt token."""
        req = s.request
        if req.params.prompt_logprobs is None or req.output_token_ids:
            return []
        stop = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
        return [(req, req.prompt_token_ids[p + 1], first_row + p - s.start) for p in range(s.start, stop)]

    def _long(self, values) -> torch.Tensor:
        return host_long(values, self.device)

    def _block_table(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        width = max((len(s.block_ids) for s in scheduled), default=1)
        rows = [s.block_ids + [0] * (width - len(s.block_ids)) for s in scheduled]
        return self._long(rows)

    def _copy_state(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            for spec in self.specs:
                if spec.kind == "state":
                    self.cache[spec.name][dst] = self.cache[spec.name][src]

    def _apply_forks(self, forks: list[ForkCopy]) -> None:
        """A forked child gets a copy of its parent's state slot and of the partial last block."""
        self._copy_state([(fork.src_slot, fork.dst_slot) for fork in forks])
        for fork in (f for f in forks if f.src_block is not None):
            for spec in self.specs:
                if spec.kind == "paged":
                    self.cache[spec.name][fork.dst_block] = self.cache[spec.name][fork.src_block]

    # --- sampling --------------------------------------------------------------------------------
    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, sample_rows: list, result: RunnerOutput):
        """Sampled requests use their last row; forked children reuse their parent's row; requests with
        drafts verify them (their rows are consecutive, one per draft plus one)."""
        drafts = {s.request.request_id: s.draft_token_ids for s in out.scheduled if s.num_drafts}
        grammar = out.grammar_bitmask.result() if out.grammar_bitmask is not None else None
        if drafts:
            self._verify(logits, sample_rows, drafts, result, grammar)
        by_id = {s.request.request_id: s for s in out.scheduled}
        parent_pos = {req.request_id: i for i, (req, _) in enumerate(sample_rows) if req.request_id not in drafts}
        requests = [sample_rows[i][0] for i in parent_pos.values()]
        rows = list(parent_pos.values())
        outputs = [self._outputs(by_id[req.request_id]) for req in requests]
        positions = [by_id[req.request_id].start + by_id[req.request_id].num_new_tokens for req in requests]
        for fork, child in zip(out.forks, out.fork_children):
            requests.append(child)
            rows.append(parent_pos[fork.parent_id])
            outputs.append([])
            positions.append(positions[parent_pos[fork.parent_id]])
        if not requests:
            return
        if self.deterministic:
            for i, req in enumerate(requests):
                self._sample_rows([req], logits[rows[i]:rows[i] + 1], [outputs[i]],
                                  [self._position_generator(req, positions[i])], result, grammar)
            return
        picked = logits if _every_row(rows, len(logits)) else logits[self._long(rows)]  # one row each: no copy
        self._sample_rows(requests, picked, outputs, [r.generator for r in requests], result, grammar)

    def _sample_rows(self, requests, logits: torch.Tensor, outputs, generators, result: RunnerOutput,
                     grammar: tuple[list[str], torch.Tensor] | None = None) -> None:
        if grammar is None and all(plain_greedy(r.params, len(out)) for r, out in zip(requests, outputs)):
            self._record(requests, SamplerOutput(logits.argmax(dim=-1)), result)  # what the sampler would pick
            return
        batch = SamplingBatch.build([r.params for r in requests], [r.prompt_token_ids for r in requests], outputs,
                                    generators, self.eos_token_ids, self.vocab_size, self.device)
        if grammar is not None:
            self._add_grammar(batch, requests, *grammar)
        self._record(requests, self.sampler(logits, batch), result)

    def _position_generator(self, req, position: int) -> torch.Generator | None:
        """Deterministic mode: the draw for this position comes from (seed, request, position) alone;
        an unseeded request is keyed by the engine seed and its id."""
        if req.params.is_greedy:
            return None
        seed = self.seed if req.params.seed is None else req.params.seed
        key = f"{req.request_id if req.params.seed is None else ''}#{req.sample_index}"
        return make_generator(position_seed(seed, key, position), self.device)

    def _verify(self, logits: torch.Tensor, sample_rows: list, drafts: dict[str, list[int]], result: RunnerOutput,
                out_grammar: tuple[list[str], torch.Tensor] | None = None):
        """Row j of a request with drafts is scored as if drafts[:j] were already in its output (penalties,
        min_tokens), then greedy or rejection-sampled verification picks the tokens."""
        picked = [(i, req) for i, (req, _) in enumerate(sample_rows) if req.request_id in drafts]
        outputs, seen = [], {}
        for _, req in picked:
            j = seen[req.request_id] = seen.get(req.request_id, -1) + 1
            outputs.append(req.output_token_ids + drafts[req.request_id][:j])
        reqs = [req for _, req in picked]
        batch = SamplingBatch.build([r.params for r in reqs], [r.prompt_token_ids for r in reqs], outputs,
                                    [r.generator for r in reqs], self.eos_token_ids, self.vocab_size, self.device)
        if out_grammar is not None:
            self._add_grammar(batch, reqs, *out_grammar)
        processed = self.sampler.process(logits[self._long([i for i, _ in picked])].float(), batch)
        probs = None if batch.all_greedy else self.sampler.filtered_probs(processed.clone(), batch)
        row = 0
        for rid, d in drafts.items():
            req, rows = reqs[row], slice(row, row + len(d) + 1)
            if req.params.is_greedy:
                verdict = verify_greedy(processed[rows], d)
            else:
                verdict = verify_random(probs[rows], d, req.generator)
            result.accepted_drafts[rid] = verdict.tokens[:-1]
            result.sampled[rid] = verdict.tokens[-1]
            row += len(d) + 1

    # --- drafting ----------------------------------------------------------------------------------
    def _propose(self, out: SchedulerOutput, meta: ForwardMeta, draft_input, result: RunnerOutput) -> None:
        items = [self._propose_item(s, meta.query_start[r], result) for r, s in enumerate(out.scheduled)]
        batch = ProposeBatch(items, draft_input, self.layout.block_size)
        for rid, draft in self.proposer.propose(batch).items():
            if draft.token_ids:
                result.drafts[rid] = draft.token_ids
                if draft.confidence is not None:
                    result.draft_confidence[rid] = draft.confidence

    def _propose_item(self, s: ScheduledRequest, first_row: int, result: RunnerOutput) -> ProposeItem:
        """What the step validated for s: its positions up to the last accepted draft, and the tokens
        (accepted drafts, the sampled token) that now follow them."""
        req, rid = s.request, s.request.request_id
        accepted = result.accepted_drafts.get(rid, [])
        valid = s.num_new_tokens - s.num_drafts + len(accepted)
        new = accepted + [result.sampled[rid]] if rid in result.sampled else []
        history = req.token_ids(0, req.num_tokens) + new
        last = s.start + valid - 1  # the last valid position; a draft model chains at last + 1, ...
        held = len(s.block_ids) * self.layout.block_size
        remaining = req.max_output_tokens - len(req.output_token_ids) - len(new)
        max_drafts = max(min(held - last, remaining - 1), 0) if new else 0
        return ProposeItem(rid, history, s.start, valid, list(range(first_row, first_row + valid)), s.block_ids,
                           s.state_slot, s.write_from, max_drafts)

    def _add_grammar(self, batch: SamplingBatch, requests: list, request_ids: list[str], bitmask: torch.Tensor):
        """Row k of `bitmask` constrains request `request_ids[k]`; the j-th row of a request among `requests`
        takes its j-th mask row (a request verifying drafts has one row per position); others are unmasked."""
        mask_rows: dict[str, list[int]] = {}
        for k, rid in enumerate(request_ids):
            mask_rows.setdefault(rid, []).append(k)
        seen: dict[str, int] = {}
        picked = []
        for i, r in enumerate(requests):
            j = seen[r.request_id] = seen.get(r.request_id, -1) + 1
            if j < len(mask_rows.get(r.request_id, ())):
                picked.append((i, mask_rows[r.request_id][j]))
        if picked:
            batch.grammar_rows = self._long([row for row, _ in picked])
            batch.grammar_bitmask = bitmask[[k for _, k in picked]].to(self.device, non_blocking=True)

    @staticmethod
    def _record(requests, sampled, result: RunnerOutput) -> None:
        tokens = sampled.sampled.tolist()
        lp = sampled.logprobs
        lp_ids = lp.token_ids.tolist() if lp is not None else None
        lp_vals = lp.logprobs.tolist() if lp is not None else None
        lp_ranks = lp.ranks.tolist() if lp is not None else None
        for i, req in enumerate(requests):
            result.sampled[req.request_id] = tokens[i]
            k = req.params.logprobs
            if lp is not None and k is not None:
                result.logprobs[req.request_id] = (lp_ids[i][: k + 1], lp_vals[i][: k + 1], lp_ranks[i])

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list, result: RunnerOutput) -> None:
        if not prompt_rows:
            return
        offset = logits.shape[0] - len(prompt_rows)
        by_request: dict[str, list[int]] = {}
        for i, (req, _, _) in enumerate(prompt_rows):
            by_request.setdefault(req.request_id, []).append(i)
        for req_id, idx in by_request.items():
            req = prompt_rows[idx[0]][0]
            targets = self._long([prompt_rows[i][1] for i in idx])
            lp = compute_prompt_logprobs(logits[offset + idx[0]: offset + idx[-1] + 1], targets,
                                         req.params.prompt_logprobs)
            result.prompt_logprobs[req_id] = (lp.token_ids, lp.logprobs, lp.ranks)
