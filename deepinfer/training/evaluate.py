"""Held-out evaluation of the bundled model: bits per byte against unigram and bigram baselines, and
for each MTP layer its top-1 accuracy and its agreement with the main model's own greedy prediction.

    python -m deepinfer.training.evaluate --run runs/default-model
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from deepinfer.training.train import fresh_cache, sequence_meta, token_stream


def byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), via the byte-level alphabet."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(i)
        special = i in tokenizer.special_token_ids or piece is None or any(c not in alphabet for c in piece)
        lengths[i] = 0 if special else len(piece)
    return lengths


def unigram_bits(train: np.ndarray, targets: np.ndarray, vocab: int) -> float:
    """Total bits of `targets` under an add-one unigram model of `train`."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    return float(-np.log2(counts[targets] / counts.sum()).sum())


def bigram_bits(train: np.ndarray, prev: np.ndarray, targets: np.ndarray, vocab: int, discount: float = 0.75) -> float:
    """Total bits under an absolute-discounting bigram interpolated with the add-one unigram
    (the standard interpolated Kneser-Ney form, with the plain unigram as the lower order)."""
    uni = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    uni /= uni.sum()
    pair = train[:-1].astype(np.int64) * vocab + train[1:]
    keys, counts = np.unique(pair, return_counts=True)
    context_total = np.bincount(keys // vocab, weights=counts, minlength=vocab)
    context_types = np.bincount(keys // vocab, minlength=vocab).astype(np.float64)
    query = prev.astype(np.int64) * vocab + targets
    pos = np.clip(np.searchsorted(keys, query), 0, len(keys) - 1)
    c_ab = np.where(keys[pos] == query, counts[pos], 0).astype(np.float64)
    c_a = context_total[prev]
    backoff = np.where(c_a > 0, discount * context_types[prev] / np.maximum(c_a, 1), 1.0)
    p = np.where(c_a > 0, np.maximum(c_ab - discount, 0) / np.maximum(c_a, 1), 0.0) + backoff * uni[targets]
    return float(-np.log2(p).sum())


@torch.no_grad()
def model_metrics(model, stream: np.ndarray, seq_len: int = 256, max_windows: int = 64) -> dict:
    """Main-model bits and, per MTP layer, accuracy / agreement, over non-overlapping windows."""
    num_mtp = len(getattr(model, "mtp", []))
    span = seq_len + 1 + num_mtp
    windows = [stream[i:i + span] for i in range(0, len(stream) - span, span)][:max_windows]
    nats, targets, prevs, mtp_hits, mtp_agree, mtp_total = [], [], [], [0] * num_mtp, [0] * num_mtp, 0
    for w in windows:
        window = torch.from_numpy(w.astype(np.int64))[None]
        fresh_cache(model, 1, seq_len, 16)
        meta = sequence_meta(1, seq_len, window[:, :seq_len], 16)
        hidden, mtp_input = model(meta, return_mtp_input=True) if num_mtp else (model(meta), None)
        logits = model.compute_logits(hidden)
        tgt = window[0, 1:seq_len + 1]
        nats.append(torch.nn.functional.cross_entropy(logits, tgt, reduction="none").numpy())
        targets.append(tgt.numpy())
        prevs.append(window[0, :seq_len].numpy())
        greedy = logits.argmax(-1)  # main model's prediction of token t+1 at position t
        for k in range(num_mtp):
            next_ids = window[0, 1 + k:seq_len + 1 + k]
            mtp_hidden, mtp_input = model.mtp_forward(k, mtp_input, next_ids, meta, return_mtp_input=True)
            pred = model.compute_logits(mtp_hidden).argmax(-1)[: seq_len - 1 - k]  # token t+2+k at position t
            mtp_hits[k] += int((pred == window[0, 2 + k:seq_len + 1]).sum())
            mtp_agree[k] += int((pred == greedy[1 + k:]).sum())
        mtp_total += seq_len - 1
    return {"nats": np.concatenate(nats), "targets": np.concatenate(targets), "prev": np.concatenate(prevs),
            "mtp_accuracy": [h / mtp_total for h in mtp_hits], "mtp_agreement": [a / mtp_total for a in mtp_agree]}


def evaluate_run(run: Path, max_windows: int = 64) -> dict:
    from deepinfer.config import ModelConfig
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer.models.loader import iter_checkpoint
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.training.train import TrainConfig

    cfg = TrainConfig(out=run)
    model_dir = run / "model"
    model = DeepseekV4ForCausalLM(ModelConfig.from_hf(model_dir))
    model.load_weights(iter_checkpoint(model_dir, "deepseek_v4"))
    model.eval()
    tok = Tokenizer.from_dir(model_dir)
    lengths = byte_lengths(tok)
    train, heldout = token_stream(cfg, "train"), token_stream(cfg, "heldout")
    m = model_metrics(model, heldout, max_windows=max_windows)
    keep = lengths[m["targets"]] > 0  # BOS targets carry no bytes; score byte-bearing tokens only
    n_bytes = int(lengths[m["targets"]].sum())
    model_bits = float(m["nats"][keep].sum()) / math.log(2)
    vocab = tok.vocab_size
    return {
        "heldout_tokens": int(len(m["targets"])), "heldout_bytes": n_bytes,
        "bits_per_byte": {"model": model_bits / n_bytes,
                          "unigram": unigram_bits(train, m["targets"][keep], vocab) / n_bytes,
                          "bigram": bigram_bits(train, m["prev"][keep], m["targets"][keep], vocab) / n_bytes},
        "mtp_top1_accuracy": m["mtp_accuracy"], "mtp_top1_agreement_with_main_greedy": m["mtp_agreement"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--max-windows", type=int, default=64)
    args = ap.parse_args(argv)
    result = evaluate_run(args.run, args.max_windows)
    (args.run / "eval.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
