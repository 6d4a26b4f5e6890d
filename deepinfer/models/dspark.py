"""DSpark-style drafter: a small parallel draft backbone on the target's hidden states, a Markov head that
conditions each draft position on the token chosen before it, and a confidence head that predicts whether
the target will accept each draft.

Weight format (a directory, documented in docs/speculative-decoding.md):
  dspark.json           {"format": "deepinfer-dspark", "version": 1, "hidden_size", "vocab_size",
                         "target_layers", "num_draft_tokens", "draft_dim", "num_blocks", "rms_norm_eps"}
  dspark.safetensors    the parameters below, by name (any float dtype; loaded as the target's dtype)

Inputs at an anchor position t (the last position the target computed, whose next token x_{t+1} is known):
features f_t = [h^{l_1}_t ; ... ; h^{l_m}_t ; embed(x_{t+1})], where h^l is the output of target block l
collapsed over its mHC streams (mean), and l = -1 names the target's final normed hidden state.

    base     = in_proj(norm_in(f_t))                                  [draft_dim]
    s_j      = blocks(base + pos[j]),  j = 0..K-1                      (parallel over draft positions)
    z_j      = s_j + markov(embed(prev_j)),  prev_0 = x_{t+1}, prev_j = draft j-1   (Markov head)
    logits_j = target.head(target.norm(out_proj(norm_out(z_j))))      (the target's head, shared)
    conf_j   = sigmoid(confidence(z_j))                                (P(draft j accepted | drafts < j accepted))

The target's embedding, final norm and head are shared, never copied.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from deepinfer.layers.norm import RMSNorm

FORMAT = "deepinfer-dspark"
CONFIG_FILE, WEIGHTS_FILE = "dspark.json", "dspark.safetensors"


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    vocab_size: int
    target_layers: tuple[int, ...] = (1, -1)
    num_draft_tokens: int = 4
    draft_dim: int = 256
    num_blocks: int = 2
    rms_norm_eps: float = 1e-6

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": 1, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> DSparkConfig:
        raw = json.loads(text)
        if raw.pop("format", None) != FORMAT or raw.pop("version", None) != 1:
            raise ValueError(f"not a {FORMAT} version 1 config")
        raw["target_layers"] = tuple(raw["target_layers"])
        return cls(**raw)


class ResidualMLP(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.silu(self.up(self.norm(x))))


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        d, dd = cfg.hidden_size, cfg.draft_dim
        n_in = (len(cfg.target_layers) + 1) * d
        self.cfg = cfg
        self.norm_in = RMSNorm(n_in, cfg.rms_norm_eps)
        self.in_proj = nn.Linear(n_in, dd, bias=False)
        self.pos = nn.Parameter(torch.zeros(cfg.num_draft_tokens, dd))
        self.blocks = nn.ModuleList(ResidualMLP(dd, cfg.rms_norm_eps) for _ in range(cfg.num_blocks))
        self.markov = nn.Linear(d, dd, bias=False)
        self.norm_out = RMSNorm(dd, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(dd, d, bias=False)
        self.confidence = nn.Linear(dd, 1)

    def backbone(self, features: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """features [N, m * D], next_embeds [N, D] -> per-position states [N, K, draft_dim]."""
        base = self.in_proj(self.norm_in(torch.cat([features, next_embeds], dim=-1)))
        s = base.unsqueeze(1) + self.pos
        for block in self.blocks:
            s = block(s)
        return s

    def position(self, state: torch.Tensor, prev_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Markov step: state [..., dd] and the previous token's embedding -> (hidden for the target head [..., D],
        confidence logit [...])."""
        z = state + self.markov(prev_embeds)
        return self.out_proj(self.norm_out(z)), self.confidence(z).squeeze(-1)

    # --- files -----------------------------------------------------------------------------------
    def save(self, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(self.cfg.to_json() + "\n")
        save_file({n: t.detach().to(dtype).contiguous() for n, t in self.state_dict().items()},
                  directory / WEIGHTS_FILE)

    @classmethod
    def load(cls, directory: Path, dtype: torch.dtype = torch.float32, device="cpu") -> DSparkDrafter:
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise ValueError(f"no DSpark drafter in {str(directory)!r} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
        drafter = cls(DSparkConfig.from_json((directory / CONFIG_FILE).read_text()))
        state = load_file(directory / WEIGHTS_FILE)
        expected = {n: tuple(t.shape) for n, t in drafter.state_dict().items()}
        wrong = sorted(n for n in expected.keys() | state.keys()
                       if n not in state or n not in expected or tuple(state[n].shape) != expected[n])
        if wrong:
            raise ValueError(f"DSpark weights do not match dspark.json: {wrong[:4]}")
        drafter.load_state_dict({n: t.float() for n, t in state.items()})
        return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


class LayerTap:
    """Forward hooks keeping the latest output of chosen target blocks, collapsed over mHC streams."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...]):
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = [model.layers[i].register_forward_hook(self._keeper(i)) for i in layers if i >= 0]

    def _keeper(self, i: int):
        def keep(module, inputs, output):
            self.outputs[i] = output.mean(dim=1) if output.dim() == 3 else output
        return keep

    def features(self, layers: tuple[int, ...], final: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows), m * D] features of the chosen layers (-1: `final`, the normed hidden) at `rows`."""
        parts = [(final if i < 0 else self.outputs[i])[rows] for i in layers]
        return torch.cat([p.to(final.dtype) for p in parts], dim=-1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
