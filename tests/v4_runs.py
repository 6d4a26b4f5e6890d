"""DeepSeek-V4 test helpers shared by test_mtp.py and test_v4_parallel.py (and its spawned workers): random
MTP tensors under DeepSeek's official names, a second checkpoint shard holding them, and `Run`, ragged cached
steps over fresh caches.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from deepinfer.config import ModelConfig
from deepinfer.distributed.model_parallel import ModelParallel
from deepinfer.layers.metadata import ForwardMeta
from deepinfer.models.deepseek_v4 import _HC_RENAMES, DeepseekV4ForCausalLM
from deepinfer.models.loader import iter_checkpoint

BLOCK = 16
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
_OFFICIAL_HC = {internal: official for official, internal in _HC_RENAMES.items()}


# --- checkpoints ---------------------------------------------------------------------------------
def randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=g))


def official_names(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Module state -> DeepSeek's checkpoint names: flat mHC names and one tensor per expert."""
    out = {}
    for name, t in state.items():
        if name.endswith("ffn.experts.w13"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif name.endswith("ffn.experts.w2"):
            out.update({f"{prefix}ffn.experts.{e}.w2.weight": t[e] for e in range(t.shape[0])})
        else:
            out[prefix + _OFFICIAL_HC.get(name, name)] = t
    return {k: v.clone().contiguous() for k, v in out.items()}


def random_mtp_tensors(config: ModelConfig, seed: int = 5) -> dict[str, torch.Tensor]:
    donor = DeepseekV4ForCausalLM(config)
    randomise(donor.mtp, seed)
    return official_names(donor.mtp[0].state_dict(), "mtp.0.")


def write_shards(path, extra: dict[str, torch.Tensor]) -> None:
    """model.safetensors -> shard 1, `extra` -> shard 2, with an index listing both."""
    (path / "model.safetensors").rename(path / SHARDS[0])
    save_file(extra, path / SHARDS[1])
    names = {n: SHARDS[0] for n in load_file(path / SHARDS[0])} | {n: SHARDS[1] for n in extra}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))


def load_v4(path, parallel: ModelParallel | None = None) -> DeepseekV4ForCausalLM:
    """The checkpoint at `path` (full tensors), as the rank `parallel` describes stores it (None: one process)."""
    model = DeepseekV4ForCausalLM(ModelConfig.from_hf(path), parallel=parallel)
    model.load_weights(iter_checkpoint(path, "deepseek_v4"))
    return model


class Run:
    """Ragged steps over fresh zeroed caches (main and MTP), one state slot and shuffled blocks per sequence."""

    def __init__(self, model: DeepseekV4ForCausalLM, seqs: list[list[int]], num_blocks: int = 32):
        self.model, self.seqs, self.done = model, seqs, [0] * len(seqs)
        specs = model.kv_cache_spec(BLOCK, include_mtp=True)
        model.bind_kv_cache({s.name: torch.zeros((num_blocks if s.kind == "paged" else len(seqs), *s.shape),
                                                 dtype=s.dtype) for s in specs})
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        width = -(-max(len(s) for s in seqs) // BLOCK)
        self.table = torch.tensor([order[r * width:(r + 1) * width] for r in range(len(seqs))])

    def meta(self, counts: list[int]) -> ForwardMeta:
        starts = list(self.done)
        ends = [s + c for s, c in zip(starts, counts)]
        self.done = ends
        pos = [list(range(s, e)) for s, e in zip(starts, ends)]
        qs = [0]
        for c in counts:
            qs.append(qs[-1] + c)
        return ForwardMeta(
            input_ids=torch.tensor([self.seqs[r][p] for r, ps in enumerate(pos) for p in ps]),
            positions=torch.tensor([p for ps in pos for p in ps]),
            token_req=torch.tensor([r for r, ps in enumerate(pos) for _ in ps]),
            block_table=self.table, state_slots=torch.arange(len(self.seqs)),
            logits_indices=torch.tensor(qs[1:]) - 1, query_start=qs, seq_starts=starts, seq_lens=ends,
            block_size=BLOCK)

    def next_ids(self, meta: ForwardMeta, k: int) -> torch.Tensor:
        """Token t + 1 + k for every row at position t (0 past the end: the caller masks those rows)."""
        seqs = self.seqs
        return torch.tensor([seqs[r][t + 1 + k] if t + 1 + k < len(seqs[r]) else 0
                             for r, t in zip(meta.token_req.tolist(), meta.positions.tolist())])

    def step(self, counts: list[int]) -> list[torch.Tensor]:
        """Main and every MTP layer's hidden rows of this step, each [T, D]."""
        meta = self.meta(counts)
        hidden, streams = self.model(meta, return_mtp_input=True)
        out = [hidden]
        for k in range(len(self.model.mtp)):
            h, streams = self.model.mtp_forward(k, streams, self.next_ids(meta, k), meta, return_mtp_input=True)
            out.append(h)
        return out
