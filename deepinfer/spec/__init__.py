"""Speculative decoding: proposers (mtp, ngram) behind one interface, the verify-length policy, stats."""

from __future__ import annotations

import torch

from deepinfer.config import SpeculativeConfig
from deepinfer.spec.base import Draft, ProposeBatch, ProposeItem, Proposer


def build_proposer(config: SpeculativeConfig | None, model: torch.nn.Module) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        from deepinfer.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    from deepinfer.spec.mtp import MTPProposer

    return MTPProposer(model, config.num_speculative_tokens)


__all__ = ["Draft", "ProposeBatch", "ProposeItem", "Proposer", "build_proposer"]
