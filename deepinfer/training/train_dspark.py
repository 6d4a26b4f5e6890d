"""Train a DSpark drafter for a (frozen) target checkpoint, by default the bundled model.

    python -m deepinfer.training.train_dspark --out runs/dspark [--minutes 25] [--resume]
        [--export deepinfer/assets/default-model/dspark]

Each step samples token windows, runs the frozen target over them once, and trains the drafter at sampled
positions t to predict tokens t + 2 .. t + 1 + K from the chosen target layers at t and the embedding of
token t + 1, with the Markov head fed the true previous tokens (teacher forcing). The confidence head
learns, by binary cross-entropy, whether the drafter's argmax at each position equals the true token.

Two data sources (`--data`):
  text       windows of the training split, tokenised with the target's tokenizer;
  generated  self-distillation: the target's own greedy continuations (EOS ignored) of `--gen-sequences`
             training-split prompts of `--prompt-len` tokens, generated once with the engine and cached.
             Positions are sampled in the continuations only, so the drafter learns to predict exactly the
             tokens greedy verification accepts (the target's argmax given the target's own previous tokens).
`--init DIR` starts from an existing drafter (same shape) instead of random weights.

Progress goes to tqdm and `log.json`; the state is saved every --save-every steps so --resume
continues exactly (weights, optimizer, step, data RNG).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from deepinfer.config import ModelConfig
from deepinfer.models.dspark import DSparkConfig, DSparkDrafter, LayerTap
from deepinfer.training.train import fresh_cache, random_windows, sequence_meta, tokenized_split


@dataclass
class DSparkTrainConfig:
    out: Path
    target: str = ""  # checkpoint directory; empty: the bundled model
    seed: int = 0
    batch: int = 8
    seq_len: int = 128
    num_draft_tokens: int = 4
    draft_dim: int = 256
    num_blocks: int = 2
    lr: float = 2e-3
    warmup: int = 50
    max_steps: int = 2000
    minutes: float = 25.0
    positions: int = 384  # positions per step that train the drafter (the target's head dominates the cost)
    confidence_weight: float = 0.2
    save_every: int = 50
    max_corpus_bytes: int = 4_000_000
    data: str = "text"  # "text" | "generated"
    prompt_len: int = 64
    gen_tokens: int = 160
    gen_sequences: int = 3000
    init: str = ""  # an existing drafter directory to continue from


def _target_path(cfg: DSparkTrainConfig) -> Path:
    from deepinfer.llm import default_model_path

    return Path(cfg.target) if cfg.target else default_model_path()


def token_stream(cfg: DSparkTrainConfig) -> np.ndarray:
    """The training split, tokenised with the target's tokenizer (BOS before each document), cached."""
    return tokenized_split(cfg.out / "data" / "train.npy", _target_path(cfg), "train", cfg.max_corpus_bytes)


def generated_sequences(cfg: DSparkTrainConfig, stream: np.ndarray) -> np.ndarray:
    """[gen_sequences, prompt_len + gen_tokens]: training-split prompts and the target's greedy continuations."""
    cache = cfg.out / "data" / f"generated_{cfg.gen_sequences}x{cfg.prompt_len}+{cfg.gen_tokens}.npy"
    if cache.exists():
        return np.load(cache)
    from deepinfer import LLM, SamplingParams

    rng = np.random.default_rng(cfg.seed)
    starts = rng.integers(0, len(stream) - cfg.prompt_len, cfg.gen_sequences)
    prompts = [{"prompt_token_ids": stream[s:s + cfg.prompt_len].tolist()} for s in starts]
    llm = LLM(cfg.target or None, load_progress=False, max_num_seqs=128, kv_cache_memory_bytes=512 * 2**20)
    params = SamplingParams(temperature=0, max_tokens=cfg.gen_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    seqs = [p["prompt_token_ids"] + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, np.asarray(seqs, dtype=np.int32))
    return np.load(cache)


class WindowSampler:
    """Token windows [batch, seq_len + 1 + K] and the flat rows (batch * seq_len) that train the drafter."""

    def __init__(self, cfg: DSparkTrainConfig, gen: torch.Generator):
        self.cfg, self.gen = cfg, gen
        stream = token_stream(cfg)
        if cfg.data == "generated":
            self.seqs = generated_sequences(cfg, stream)
            self.seq_len = self.seqs.shape[1] - 1 - cfg.num_draft_tokens
        elif cfg.data == "text":
            self.stream, self.seq_len = stream, cfg.seq_len
        else:
            raise ValueError(f"--data must be 'text' or 'generated', not {cfg.data!r}")

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, gen = self.cfg, self.gen
        if cfg.data == "text":
            window = random_windows(self.stream, cfg.batch, self.seq_len + 1 + cfg.num_draft_tokens, gen)
            return window, torch.randperm(cfg.batch * self.seq_len, generator=gen)[:cfg.positions]
        window = self.seqs[torch.randint(0, len(self.seqs), (cfg.batch,), generator=gen).numpy()]
        # anchors t >= prompt_len - 1: every drafted token t + 2 .. is the target's own greedy output
        first = cfg.prompt_len - 1
        valid = (torch.arange(cfg.batch)[:, None] * self.seq_len + torch.arange(first, self.seq_len)).flatten()
        rows = valid[torch.randperm(len(valid), generator=gen)[:cfg.positions]]
        return torch.from_numpy(window.astype(np.int64)), rows


def load_target(cfg: DSparkTrainConfig):
    from deepinfer.engine.core import load_model

    path = _target_path(cfg)
    model = load_model(path, ModelConfig.from_hf(path), torch.float32, torch.device("cpu"))
    return model.requires_grad_(False)


def draft_losses(target, drafter: DSparkDrafter, tap: LayerTap, window: torch.Tensor, seq_len: int,
                 rows: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """(cross-entropy, confidence BCE, accuracy by draft position) at `rows` (flat batch * seq_len positions)."""
    k, batch = drafter.cfg.num_draft_tokens, window.shape[0]
    with torch.no_grad():
        fresh_cache(target, batch, seq_len, block)
        final = target(sequence_meta(batch, seq_len, window[:, :seq_len], block))
        feats = tap.features(drafter.cfg.target_layers, final, rows)
        embed = target.embed
        next_embeds = embed(window[:, 1:seq_len + 1]).reshape(batch * seq_len, -1)[rows]
        prev = torch.stack([window[:, 1 + j:seq_len + 1 + j] for j in range(k)], -1).reshape(-1, k)[rows]
        gold = torch.stack([window[:, 2 + j:seq_len + 2 + j] for j in range(k)], -1).reshape(-1, k)[rows]
        prev_embeds = embed(prev)
    states = drafter.backbone(feats, next_embeds)  # [N, K, dd]
    hidden, conf_logits = drafter.position(states, prev_embeds)
    logits = target.compute_logits(target.norm(hidden))  # [N, K, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), gold.reshape(-1))
    hit = (logits.argmax(-1) == gold).float()
    bce = F.binary_cross_entropy_with_logits(conf_logits, hit)
    return ce, bce, hit.mean(0).tolist()


def train(cfg: DSparkTrainConfig, resume: bool = False, export: Path | None = None) -> Path:
    torch.manual_seed(cfg.seed)
    cfg.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    sampler = WindowSampler(cfg, gen)
    target = load_target(cfg)
    dcfg = DSparkConfig(target.config.hidden_size, target.config.vocab_size, num_draft_tokens=cfg.num_draft_tokens,
                        draft_dim=cfg.draft_dim, num_blocks=cfg.num_blocks, rms_norm_eps=target.config.rms_norm_eps)
    drafter = DSparkDrafter.load(Path(cfg.init)) if cfg.init else DSparkDrafter(dcfg)
    if drafter.cfg != dcfg:
        raise ValueError(f"--init {cfg.init!r} holds a drafter of another shape: {drafter.cfg} vs {dcfg}")
    drafter.train().requires_grad_(True)
    tap = LayerTap(target, dcfg.target_layers)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step, log, state_path = 0, [], cfg.out / "train_state.pt"
    if resume and state_path.exists():
        state = torch.load(state_path, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, log = state["step"], state["log"]
    deadline = time.monotonic() + cfg.minutes * 60
    bar = tqdm(total=cfg.max_steps, initial=step, desc="training dspark", unit="step")
    while step < cfg.max_steps and time.monotonic() < deadline:
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        window, rows = sampler.sample()
        ce, bce, acc = draft_losses(target, drafter, tap, window, sampler.seq_len, rows)
        opt.zero_grad(set_to_none=True)
        (ce + cfg.confidence_weight * bce).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        log.append({"step": step, "ce": ce.item(), "bce": bce.item(), "acc": acc, "time": time.time()})
        bar.update(1)
        bar.set_postfix(ce=f"{ce.item():.3f}", acc=" ".join(f"{a:.2f}" for a in acc))
        if step % cfg.save_every == 0:
            _save(state_path, drafter, opt, gen, step, log)
    bar.close()
    _save(state_path, drafter, opt, gen, step, log)
    (cfg.out / "log.json").write_text(json.dumps(log))
    plot_log(log, cfg.out / "training.png")
    drafter.save(cfg.out / "dspark")
    if export is not None:
        drafter.save(export)
    return cfg.out / "dspark"


def plot_log(log: list[dict], path: Path, title: str = "DSpark training") -> None:
    """Cross-entropy and teacher-forced top-1 accuracy by draft position (50-step means); with matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return
    if not log:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = min(50, len(log))
    steps = [r["step"] for r in log][window - 1:]
    smooth = lambda xs: np.convolve(xs, np.ones(window) / window, mode="valid")  # noqa: E731
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(steps, smooth([r["ce"] for r in log]))
    a.set(xlabel="step", ylabel="cross-entropy (nats)", title=title)
    for j in range(len(log[0]["acc"])):
        b.plot(steps, smooth([r["acc"][j] for r in log]), label=f"draft position {j + 1}")
    b.set(xlabel="step", ylabel="top-1 accuracy (teacher forced)", ylim=(0, 1), title="accuracy by draft position")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lr(step: int, cfg: DSparkTrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min((step - cfg.warmup) / max(cfg.max_steps - cfg.warmup, 1), 1.0)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _save(path: Path, drafter, opt, gen, step: int, log: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"drafter": drafter.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                "log": log}, tmp)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export", type=Path, help="also write the drafter here (e.g. next to the target)")
    for f in fields(DSparkTrainConfig):
        if f.name != "out":
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = vars(ap.parse_args(argv))
    resume, export = args.pop("resume"), args.pop("export")
    print(train(DSparkTrainConfig(**args), resume=resume, export=export))


if __name__ == "__main__":
    main()
