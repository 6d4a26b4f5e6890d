"""DeepSeek-V4.1's vision tower: a ViT over one image's patch grid (full attention, 2-D rotary) and the aligner that
merges each downsample x downsample patch cell into one LLM token.

Numerics follow DeepSeek's reference (bf16 activations): the norms compute in float32 with float32 weights and
cast back, the rotary rotates in float32, attention is SDPA on the bf16 heads, the aligner's GELU is exact (erf).
Parameter names are the checkpoint's (`vision.*`, `aligner.*`). One image per call: its attention sees only its own
patches, so batching images would change nothing but memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config_v41 import VisionConfig
from deepinfer.layers.norm import RMSNorm

_VIT_EPS = 1e-6  # the ViT's norms use their own epsilon, not the text model's


def grid_rotations(n_h: int, n_w: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h * n_w, 1, dim] for patches in reading order: frequencies 1 / theta^(2i / dim); the first half
    of each row rotates by the patch's row, the second half by its column."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rows = torch.arange(n_h).repeat_interleave(n_w)
    cols = torch.arange(n_w).repeat(n_h)
    angles = (torch.stack([rows, cols], dim=-1).float()[..., None] * inv_freq).flatten(1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of the last dim in float32; the result keeps x's dtype."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.proj = nn.Linear(3 * cfg.patch_size ** 2, cfg.hidden_size, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, dtype=dtype)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with gate and up fused in w1 (gate first); no biases."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dtype)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size, _VIT_EPS), RMSNorm(cfg.hidden_size, _VIT_EPS)
        self.attn, self.mlp = VisionAttention(cfg, dtype), VisionMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """`vision.*`: patches [n_h * n_w, 3, p, p] in reading order -> features [n_h * n_w, hidden]."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, _VIT_EPS)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"{patches.shape[0]} patches for a {n_h} x {n_w} grid")
        x = self.patch_embed(patches)
        cos, sin = (t.to(x.device) for t in grid_rotations(n_h, n_w, self.cfg.head_dim // 2, self.cfg.rope_theta))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """`aligner.*`: each r x r cell of the feature grid (zero-padded at the right / bottom edge), flattened channel
    major, through Linear -> GELU -> Linear into the text model's width; cells in reading order."""

    def __init__(self, cfg: VisionConfig, text_dim: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.r = cfg.downsample_ratio
        self.w1 = nn.Linear(cfg.hidden_size * self.r ** 2, text_dim, dtype=dtype)
        self.w2 = nn.Linear(text_dim, text_dim, dtype=dtype)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        r = self.r
        grid = F.pad(x.view(n_h, n_w, -1).permute(2, 0, 1), (0, -n_w % r, 0, -n_h % r))
        cells = F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)
        return self.w2(F.gelu(self.w1(cells)))


def llm_grid(n_vit_h: int, n_vit_w: int, downsample: int) -> tuple[int, int]:
    """The aligner's token grid for a patch grid."""
    return -(-n_vit_h // downsample), -(-n_vit_w // downsample)
