"""Speculative decoding: proposers (mtp, ngram, dspark) behind one interface, the verify-length policy, stats."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.config import SpeculativeConfig
from deepinfer.spec.base import Draft, ProposeBatch, ProposeItem, Proposer


def build_proposer(config: SpeculativeConfig | None, model: torch.nn.Module,
                   model_path: str | Path | None = None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "dspark":
        from deepinfer.spec.dspark import DSparkProposer

        path = config.model or (Path(model_path) / "dspark" if model_path is not None else None)
        if path is None:
            raise ValueError("speculative method 'dspark' needs speculative_config['model'] (a drafter directory)")
        return DSparkProposer(model, config.num_speculative_tokens, path)
    if config.method == "ngram":
        from deepinfer.spec.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    from deepinfer.spec.mtp import MTPProposer

    return MTPProposer(model, config.num_speculative_tokens)


__all__ = ["Draft", "ProposeBatch", "ProposeItem", "Proposer", "build_proposer"]
