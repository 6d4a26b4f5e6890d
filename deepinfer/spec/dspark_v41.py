"""DSpark drafting with DeepSeek-V4.1's own head (the checkpoint's `mtp.{K}.*` stages, models/dspark_v41.py).

Each step the head consumes every position the target just validated: the target returns, beside its hidden
states, the tap features of its `dspark.target_layer_ids` (hidden_kind "mtp"), and each stage writes their
main-model KV into its window ring (position-indexed, so a rejected draft's slot is simply rewritten when the
position is validated later). Then one draft block runs from each drafting request's last validated position P:
the block's logits with the Markov walk give min(k, block_size, max_drafts) greedy drafts, and the confidence
head's logit, through a sigmoid, is the predicted acceptance the verify-length policy reads.
"""

from __future__ import annotations

import torch

from deepinfer.spec.base import Draft, ProposeBatch, Proposer


def has_own_dspark(model: torch.nn.Module) -> bool:
    """Whether `model` is a V4.1 model whose config declares the DSpark head (drafts need no drafter dir)."""
    v41 = getattr(getattr(model, "config", None), "v41", None)
    return v41 is not None


class V41DSparkProposer(Proposer):
    hidden_kind = "mtp"  # the model's forward(meta, return_mtp_input=True): (hidden, taps)

    def __init__(self, model: torch.nn.Module, k: int):
        from deepinfer.models.dspark_v41 import DSparkHead

        ds = model.config.v41.dspark
        if ds is None or not len(model.mtp):
            raise ValueError("speculative method 'dspark' on DeepSeek-V4.1 drafts with the checkpoint's own DSpark "
                             "head, and this config has none (dspark_block_size / num_nextn_predict_layers unset)")
        if not model.mtp_loaded:
            raise ValueError("speculative method 'dspark' needs the checkpoint's DSpark head (mtp.* tensors), and "
                             "this DeepSeek-V4.1 checkpoint has none")
        if k > ds.block_size:
            raise ValueError(f"num_speculative_tokens {k} exceeds the DSpark head's block of {ds.block_size} drafts")
        self.model, self.k, self.head = model, k, DSparkHead(model)

    def propose(self, batch: ProposeBatch) -> dict[str, Draft]:
        items = [it for it in batch.items if it.num_valid > 0]
        if not items:
            return {}
        dev = batch.hidden.device
        long = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
        rows = long([r for it in items for r in it.rows])
        positions = long([p for it in items for p in range(it.start, it.start + it.num_valid)])
        slots = long([it.state_slot for it in items for _ in range(it.num_valid)])
        self.head.consume(batch.hidden[rows], positions, slots)
        drafting = [it for it in items if min(self.k, it.max_drafts) > 0]
        if not drafting:
            return {}
        tokens, _, conf = self.draft(long([it.history[it.start + it.num_valid] for it in drafting]),
                                     long([it.start + it.num_valid - 1 for it in drafting]),
                                     long([it.state_slot for it in drafting]))
        tok, prob = tokens[:, 1:].tolist(), torch.sigmoid(conf).tolist()
        return {it.request_id: Draft(tok[i][:min(self.k, it.max_drafts)], prob[i][:min(self.k, it.max_drafts)])
                for i, it in enumerate(drafting)}

    def draft(self, next_ids: torch.Tensor, last: torch.Tensor, slots: torch.Tensor):
        """(tokens [R, B + 1], logits [R, B, vocab], confidence logits [R, B]) of one draft block per request."""
        return self.head.draft(next_ids, last, slots)
