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
        from deepinfer.spec.dspark_v41 import V41DSparkProposer, has_own_dspark

        if has_own_dspark(model):  # V4.1 ships its own DSpark head in the checkpoint (mtp.*)
            if config.model is not None:
                raise ValueError("DeepSeek-V4.1 drafts with its checkpoint's own DSpark head: drop "
                                 "speculative_config['model']")
            return V41DSparkProposer(model, config.num_speculative_tokens)

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
