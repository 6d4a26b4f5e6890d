"""Train the bundled DeepSeek-V4-architecture model with the project's own model code and autograd.

    python -m deepinfer.training.train --out runs/default-model [--minutes 55] [--resume]

Reproducible from --seed; checkpoints every --save-every steps (an interrupted run resumes with
--resume); writes a loss log (JSON) and a loss curve (PNG), then exports the final checkpoint.
The loss is next-token cross-entropy plus, for each MTP layer k, cross-entropy of token t+2+k
(weighted by --mtp-weight). Learned routers are balanced without an auxiliary loss: each step
nudges `gate.bias` towards under-loaded experts.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from deepinfer.config import ModelConfig
from deepinfer.layers.metadata import ForwardMeta
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, Gate
from deepinfer.training.export import init_weights, save_checkpoint

# The bundled model: every V4 component at a scale where windows and compression matter within a
# few hundred tokens (window 32, CSA every 4 tokens with top-8 selection, HCA every 16 tokens).
DEFAULT_MODEL = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
    vocab_size=8192, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=64,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, norm_topk_prob=True,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=32, index_n_heads=4, index_head_dim=32, index_topk=8, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=4096, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
)


@dataclass
class TrainConfig:
    out: Path
    seed: int = 0
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    max_steps: int = 800
    minutes: float = 58.0
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    bias_update: float = 1e-3
    save_every: int = 100
    vocab_size: int = 8192
    max_corpus_bytes: int | None = None


# --- data --------------------------------------------------------------------------------------------
def token_stream(cfg: TrainConfig, split: str) -> np.ndarray:
    """The split tokenised once (BOS before each document) and cached next to the run."""
    return tokenized_split(cfg.out / "data" / f"{split}.npy", cfg.out / "tokenizer", split, cfg.max_corpus_bytes)


def tokenized_split(cache: Path, tokenizer_dir: Path, split: str, max_bytes: int | None) -> np.ndarray:
    """Corpus `split` tokenised with the tokenizer in `tokenizer_dir` (BOS before each document), cached."""
    if cache.exists():
        return np.load(cache)
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.training import corpus

    tok = Tokenizer.from_dir(tokenizer_dir)
    docs = list(corpus.iter_documents(split, max_bytes=max_bytes))
    ids = [t for enc in tok.inner.encode_batch(docs, add_special_tokens=False) for t in [tok.bos_token_id, *enc.ids]]
    arr = np.asarray(ids, dtype=np.int32)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    return arr


def sample_batch(stream: np.ndarray, cfg: TrainConfig, extra: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1 + extra] random windows of the stream."""
    return random_windows(stream, cfg.batch, cfg.seq_len + 1 + extra, gen)


def random_windows(stream: np.ndarray, count: int, span: int, gen: torch.Generator) -> torch.Tensor:
    """[count, span] windows of the stream at random starts (int64)."""
    starts = torch.randint(0, len(stream) - span, (count,), generator=gen).tolist()
    return torch.from_numpy(np.stack([stream[s:s + span] for s in starts]).astype(np.int64))


def sequence_meta(batch: int, length: int, tokens: torch.Tensor, block_size: int) -> ForwardMeta:
    """B independent sequences at positions 0..length-1, each with its own blocks and state slot."""
    blocks = -(-length // block_size)
    return ForwardMeta(
        input_ids=tokens.reshape(-1), positions=torch.arange(length).repeat(batch),
        token_req=torch.arange(batch).repeat_interleave(length),
        block_table=torch.arange(batch * blocks).view(batch, blocks), state_slots=torch.arange(batch),
        logits_indices=torch.arange(batch * length), query_start=[i * length for i in range(batch + 1)],
        seq_starts=[0] * batch, seq_lens=[length] * batch, block_size=block_size)


def fresh_cache(model: DeepseekV4ForCausalLM, batch: int, length: int, block_size: int) -> None:
    blocks = batch * -(-length // block_size)
    tensors = {s.name: torch.zeros((blocks if s.kind == "paged" else batch, *s.shape), dtype=s.dtype)
               for s in model.kv_cache_spec(block_size, include_mtp=True)}
    model.bind_kv_cache(tensors)


# --- loss --------------------------------------------------------------------------------------------
def losses(model: DeepseekV4ForCausalLM, window: torch.Tensor, seq_len: int, block_size: int) -> list[torch.Tensor]:
    """[main CE, MTP-1 CE, ...] for a batch of token windows [B, seq_len + 1 + num_mtp]."""
    batch = window.shape[0]
    fresh_cache(model, batch, seq_len, block_size)
    meta = sequence_meta(batch, seq_len, window[:, :seq_len], block_size)
    num_mtp = len(getattr(model, "mtp", []))
    hidden, mtp_input = model(meta, return_mtp_input=True) if num_mtp else (model(meta), None)
    out = [F.cross_entropy(model.compute_logits(hidden), window[:, 1:seq_len + 1].reshape(-1))]
    for k in range(num_mtp):
        next_ids = window[:, 1 + k:seq_len + 1 + k].reshape(-1)
        mtp_hidden, mtp_input = model.mtp_forward(k, mtp_input, next_ids, meta, return_mtp_input=True)
        out.append(F.cross_entropy(model.compute_logits(mtp_hidden), window[:, 2 + k:seq_len + 2 + k].reshape(-1)))
    return out


class RouterBalancer:
    """Aux-loss-free balancing: count each learned gate's expert choices; nudge biases after a step."""

    def __init__(self, model: DeepseekV4ForCausalLM, rate: float):
        self.rate, self.loads = rate, {}
        for module in model.modules():
            if isinstance(module, Gate) and not module.is_hash:
                module.register_forward_hook(self._record)

    def _record(self, module, inputs, output) -> None:
        ids = output[0].detach().reshape(-1)
        counts = torch.bincount(ids, minlength=module.weight.shape[0]).float()
        self.loads[module] = self.loads.get(module, 0) + counts

    @torch.no_grad()
    def update(self) -> None:
        for gate, load in self.loads.items():
            gate.bias.add_(self.rate * torch.sign(load.mean() - load))
        self.loads.clear()


# --- optimisation ------------------------------------------------------------------------------------
def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2 and not n.endswith("gate.bias")]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(step: int, cfg: TrainConfig, total: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min((step - cfg.warmup) / max(total - cfg.warmup, 1), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(seed: int) -> tuple[DeepseekV4ForCausalLM, dict]:
    hf_config = dict(DEFAULT_MODEL)
    model = DeepseekV4ForCausalLM(ModelConfig.from_dict(hf_config))
    init_weights(model, seed=seed)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("gate.bias"))
    return model, hf_config


# --- checkpoints -------------------------------------------------------------------------------------
def save_state(path: Path, model, opt, step: int, gen: torch.Generator, log: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "gen": gen.get_state(), "log": log}, tmp)
    tmp.replace(path)


def load_state(path: Path, model, opt, gen: torch.Generator) -> tuple[int, list]:
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    return state["step"], state["log"]


def plot_losses(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [e["step"] for e in log]
    ax.plot(steps, [e["loss"] for e in log], label="next token", lw=1)
    for k in range(len(log[0]["mtp"]) if log else 0):
        ax.plot(steps, [e["mtp"][k] for e in log], label=f"MTP {k + 1} (token t+{k + 2})", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("bundled model training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main loop ---------------------------------------------------------------------------------------
def train(cfg: TrainConfig, resume: bool = False) -> Path:
    torch.manual_seed(cfg.seed)
    cfg.out.mkdir(parents=True, exist_ok=True)
    _ensure_tokenizer(cfg)
    stream = token_stream(cfg, "train")
    model, hf_config = build_model(cfg.seed)
    model.train()
    opt = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, log = 0, []
    state_path = cfg.out / "train_state.pt"
    if resume and state_path.exists():
        step, log = load_state(state_path, model, opt, gen)
    balancer = RouterBalancer(model, cfg.bias_update)
    num_mtp, block = len(getattr(model, "mtp", [])), 16
    deadline = time.monotonic() + cfg.minutes * 60
    bar = tqdm(total=cfg.max_steps, initial=step, desc="training", unit="step")
    while step < cfg.max_steps and time.monotonic() < deadline:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg, cfg.max_steps)
        parts = losses(model, sample_batch(stream, cfg, num_mtp, gen), cfg.seq_len, block)
        total = parts[0] + cfg.mtp_weight * sum(parts[1:])
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balancer.update()
        step += 1
        log.append({"step": step, "loss": parts[0].item(), "mtp": [p.item() for p in parts[1:]],
                    "lr": opt.param_groups[0]["lr"], "time": time.time()})
        bar.update(1)
        bar.set_postfix(loss=f"{parts[0].item():.3f}", mtp=" ".join(f"{p.item():.3f}" for p in parts[1:]))
        if step % cfg.save_every == 0:
            save_state(state_path, model, opt, step, gen, log)
    bar.close()
    save_state(state_path, model, opt, step, gen, log)
    (cfg.out / "loss_log.json").write_text(json.dumps(log))
    plot_losses(log, cfg.out / "loss_curve.png")
    final = save_checkpoint(model.eval(), hf_config, cfg.out / "model")
    _copy_tokenizer(cfg.out / "tokenizer", final)
    return final


def _ensure_tokenizer(cfg: TrainConfig) -> None:
    from deepinfer.training.tokenizer_train import train_tokenizer

    if not (cfg.out / "tokenizer" / "tokenizer.json").exists():
        train_tokenizer(cfg.out / "tokenizer", vocab_size=cfg.vocab_size, max_bytes=cfg.max_corpus_bytes)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", action="store_true")
    for name, default in TrainConfig.__dataclass_fields__.items():
        if name != "out":
            value = default.default
            kind = int if name == "max_corpus_bytes" else type(value)
            ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    args = vars(ap.parse_args(argv))
    resume = args.pop("resume")
    print(train(TrainConfig(**args), resume=resume))


if __name__ == "__main__":
    main()
