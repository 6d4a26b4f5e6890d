"""MTP drafting with the checkpoint's own multi-token-prediction layer (V4 `mtp.0.*`, V3 `model.layers.{N}.*`).

Each step the MTP layer consumes every position the target just validated (catch-up), in its own
`mtp.0` caches: row t pairs the target's final streams at t with the embedding of token t + 1, so its
cache holds exactly the positions the target's does and a rejected draft rolls back both with one
counter. The last row predicts the first draft. Further drafts chain the same layer (the last one
shipped; checkpoints ship one): position P + j takes the layer's own output streams at P + j - 1 and
the previous draft. Those chain positions are lookahead: the next catch-up recomputes them with the
target's streams. Drafts are greedy (argmax of the MTP head); the confidence of a draft is the MTP
head's probability of it, which the adaptive verify policy multiplies along the chain.
"""

from __future__ import annotations

import torch

from deepinfer.layers.metadata import ForwardMeta
from deepinfer.spec.base import Draft, ProposeBatch, ProposeItem, Proposer


class MTPProposer(Proposer):
    hidden_kind = "mtp"

    def __init__(self, model: torch.nn.Module, k: int):
        if not getattr(model, "mtp_loaded", False):
            raise ValueError("speculative method 'mtp' needs the checkpoint's MTP weights, and this checkpoint "
                             "has none (num_nextn_predict_layers = 0, or its mtp.* tensors were dropped)")
        if hasattr(model, "build_mtp"):
            model.build_mtp()  # V3: layers built from the checkpoint's model.layers.{N + k}.* tensors
        self.model, self.k = model, k

    def propose(self, batch: ProposeBatch) -> dict[str, Draft]:
        items = batch.items
        if not items:
            return {}
        meta = _meta([(it.start, it.num_valid, it.history[it.start + 1: it.start + it.num_valid + 1], it)
                      for it in items], batch.block_size, batch.hidden.device)
        rows = torch.tensor([r for it in items for r in it.rows], dtype=torch.long, device=batch.hidden.device)
        hidden, streams = self.model.mtp_forward(0, batch.hidden[rows], meta.input_ids, meta, return_mtp_input=True)
        drafting = [i for i, it in enumerate(items) if min(self.k, it.max_drafts) > 0]
        drafts = {items[i].request_id: Draft([], []) for i in drafting}
        last = [meta.query_start[i + 1] - 1 for i in drafting]
        pos = {i: items[i].start + items[i].num_valid for i in drafting}  # position of the next chain row
        for j in range(self.k):
            if not drafting:
                break
            tokens = self._pick(hidden[last], [drafts[items[i].request_id] for i in drafting])
            drafting_next = [i for i, t in zip(drafting, tokens) if j + 1 < min(self.k, items[i].max_drafts)]
            if not drafting_next or j + 1 == self.k:
                break
            keep = [drafting.index(i) for i in drafting_next]
            chain = _meta([(pos[i], 1, [tokens[drafting.index(i)]], items[i]) for i in drafting_next],
                          batch.block_size, hidden.device)
            hidden, streams = self.model.mtp_forward(0, streams[[last[x] for x in keep]], chain.input_ids, chain,
                                                     return_mtp_input=True)
            drafting, last = drafting_next, list(range(len(drafting_next)))
            for i in drafting:
                pos[i] += 1
        return drafts

    def _pick(self, hidden: torch.Tensor, drafts: list[Draft]) -> list[int]:
        logits = self.model.compute_logits(hidden)
        best, tok = logits.max(dim=-1)
        conf = (best - logits.logsumexp(dim=-1)).exp()  # the head's probability of its argmax
        tokens = tok.tolist()
        for d, t, c in zip(drafts, tokens, conf.tolist()):
            d.token_ids.append(t)
            d.confidence.append(c)
        return tokens


def _meta(spans: list[tuple[int, int, list[int], ProposeItem]], block_size: int, device) -> ForwardMeta:
    """A ragged step over (start, count, next tokens, item) spans in each item's cache."""
    ids, positions, token_req, qstart = [], [], [], [0]
    for r, (start, n, nxt, _) in enumerate(spans):
        ids += nxt
        positions += range(start, start + n)
        token_req += [r] * n
        qstart.append(qstart[-1] + n)
    width = max(len(it.block_ids) for *_, it in spans)
    table = [it.block_ids + [0] * (width - len(it.block_ids)) for *_, it in spans]
    long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return ForwardMeta(long(ids), long(positions), long(token_req), long(table),
                       long([it.state_slot for *_, it in spans]), long([q - 1 for q in qstart[1:]]), qstart,
                       [s for s, *_ in spans], [s + n for s, n, *_ in spans], block_size,
                       paged_write_from=[max(s, it.write_from) for s, _, _, it in spans])
