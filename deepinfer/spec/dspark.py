"""DSpark drafting: the drafter (models/dspark.py) reads the target's hidden states at each request's last
validated position, drafts all positions with its parallel backbone, then walks the Markov head position by
position (each conditioned on the previous draft). It keeps no cache, so a rejection needs no rollback here.
The confidence head's probabilities go to the verify-length policy."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.models.dspark import DSparkDrafter, LayerTap
from deepinfer.spec.base import Draft, ProposeBatch, Proposer


def _parts(model: torch.nn.Module):
    """(blocks, embedding, final norm) of a V4 model (or an MLA model)."""
    inner = getattr(model, "model", None)
    if hasattr(model, "embed"):
        return model, model.embed, model.norm
    return inner, inner.embed_tokens, inner.norm


class DSparkProposer(Proposer):
    hidden_kind = "final"
    graph_safe = False  # the LayerTap's forward hooks capture the target layers' hidden states

    def __init__(self, model: torch.nn.Module, k: int, path: str | Path):
        param = next(model.parameters())
        self.drafter = DSparkDrafter.load(Path(path), dtype=model.dtype, device=param.device)
        cfg = self.drafter.cfg
        if (cfg.hidden_size, cfg.vocab_size) != (model.config.hidden_size, model.config.vocab_size):
            raise ValueError(f"the DSpark drafter in {str(path)!r} was built for hidden size {cfg.hidden_size} and "
                             f"vocabulary {cfg.vocab_size}, not this model's")
        if k > cfg.num_draft_tokens:
            raise ValueError(f"num_speculative_tokens {k} exceeds the {cfg.num_draft_tokens} draft positions this "
                             "DSpark drafter was trained for")
        self.model, self.k = model, k
        holder, self.embed, self.norm = _parts(model)
        self.tap = LayerTap(holder, cfg.target_layers)

    def propose(self, batch: ProposeBatch) -> dict[str, Draft]:
        items = [it for it in batch.items if min(self.k, it.max_drafts) > 0]
        if not items:
            return {}
        dev = batch.hidden.device
        rows = torch.tensor([it.rows[-1] for it in items], dtype=torch.long, device=dev)
        nxt = torch.tensor([it.history[it.start + it.num_valid] for it in items], dtype=torch.long, device=dev)
        feats = self.tap.features(self.drafter.cfg.target_layers, batch.hidden, rows)
        states = self.drafter.backbone(feats, self.embed(nxt))
        tokens, confs, prev = [], [], nxt
        for j in range(max(min(self.k, it.max_drafts) for it in items)):
            hidden, conf = self.drafter.position(states[:, j], self.embed(prev))
            prev = self.model.compute_logits(self.norm(hidden)).argmax(dim=-1)
            tokens.append(prev)
            confs.append(torch.sigmoid(conf.float()))
        tok, conf = torch.stack(tokens, 1).tolist(), torch.stack(confs, 1).tolist()
        return {it.request_id: Draft(tok[i][:min(self.k, it.max_drafts)], conf[i][:min(self.k, it.max_drafts)])
                for i, it in enumerate(items)}
