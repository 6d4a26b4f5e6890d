"""DeepSeek-V4.1 Engram: n-gram hash ids per token, and the FP8 hash tables they index.

Hashing (everything derives from the token ids, so it runs before the forward reaches an Engram layer):
token ids pass through a compressed map (tokens that normalise alike share an id); position p forms the
2..N-grams ending at p from the compressed ids of p, p-1, ... (slots before the sequence start hold the pad's
compressed id); per Engram layer the ids are multiplied by that layer's odd multipliers, XOR-folded one
look-back at a time, and the running value after folding n tokens is taken modulo a distinct prime per
(layer, n, head), plus that (n, head)'s row offset in the layer's table. Result: (N - 1) * heads rows per token.

Tables: [rows, head_dim] FP8 E4M3 with one UE8M0 scale per 32 values of a row. In production they are ~200 GB,
so they stay quantised and memory-mapped from the checkpoint's safetensors on the host; a step gathers only its
tokens' rows (`EngramTable.rows`).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np
import torch

from deepinfer.config_v41 import EngramConfig

_SPACE_SENTINEL = "\ue000"  # keeps a token that is exactly one space from collapsing to the empty string


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def bucket_primes(cfg: EngramConfig) -> list[list[list[int]]]:
    """[layer][n-gram size - 2][head] moduli: for each (layer, n) the heads take, in order, the smallest primes
    >= bucket_start not handed out before (over all layers), so every bucket range is distinct."""
    seen, primes = set(), []
    for _ in cfg.layer_ids:
        per_layer = []
        for _ in range(cfg.max_ngram_size - 1):
            sizes, candidate = [], cfg.bucket_start - 1
            for _ in range(cfg.n_heads):
                candidate += 1
                while not _is_prime(candidate) or candidate in seen:
                    candidate += 1
                seen.add(candidate)
                sizes.append(candidate)
            per_layer.append(sizes)
        primes.append(per_layer)
    return primes


def hash_multipliers(cfg: EngramConfig) -> torch.Tensor:
    """[layers, max_ngram] odd int64 multipliers from numpy's default_rng(10007 * layer id), bounded so that
    compressed id * multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // cfg.compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(cfg.max_ngram_size,), dtype=np.int64)
            for layer in cfg.layer_ids]
    return torch.from_numpy(np.stack(rows) * 2 + 1)


def compressed_token_map(tokenizer, vocab_size: int) -> tuple[torch.Tensor, int]:
    """(id -> compressed id [max(vocab, tokenizer size)], number of compressed ids) from a `tokenizers.Tokenizer`:
    each token's raw decode normalised (NFKC, NFD, strip accents, lowercase, whitespace runs to one space,
    stripped; a lone space kept). Partial UTF-8 tokens key by their raw token string. Ids past the tokenizer (a
    padded vocab) share one extra compressed id, distinct from every real token's."""
    from tokenizers import Regex, normalizers

    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SPACE_SENTINEL, " ")])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    lookup = []
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        key = tokenizer.id_to_token(token_id) if "\ufffd" in text else (norm.normalize_str(text) or text)
        lookup.append(keys.setdefault(key, len(keys)))
    count = len(keys)
    lookup += [count] * max(0, vocab_size - size)
    return torch.tensor(lookup, dtype=torch.long), count


class NgramHasher:
    """Hash row ids [T, engram layers, (N - 1) * heads] of tokens given their compressed ids and look-back."""

    def __init__(self, cfg: EngramConfig, token_map: torch.Tensor):
        primes = bucket_primes(cfg)
        flat = [[p for per_n in layer for p in per_n] for layer in primes]
        self.n = cfg.max_ngram_size
        self.token_map = token_map
        self.pad = int(token_map[cfg.pad_token_id])
        self.primes = torch.tensor(primes, dtype=torch.long)  # [layers, N - 1, heads]
        self.offsets = torch.tensor(np.array([np.cumsum([0, *sizes[:-1]]) for sizes in flat]), dtype=torch.long)
        self.multipliers = hash_multipliers(cfg)  # [layers, N]
        self.table_rows = [sum(sizes) for sizes in flat]

    def hashes(self, history: torch.Tensor) -> torch.Tensor:
        """history [T, N]: compressed ids of positions p, p-1, ..., p-N+1 of each token (-1: before the start)."""
        blocked = torch.cumsum((history < 0).long(), dim=1) > 0  # look-back stops at the sequence start
        tokens = torch.where(blocked, self.pad, history)
        products = tokens.unsqueeze(1) * self.multipliers  # [T, layers, N]
        rolling, out = products[..., 0], []
        for i in range(1, self.n):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            out.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        return torch.cat(out, dim=-1) + self.offsets


class EngramTable:
    """One layer's FP8 table and UE8M0 row scales, memory-mapped (copy-on-write, never written) from a
    safetensors file: `rows(ids)` reads and dequantises only the rows asked for."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, name: str):
        if weight.dim() != 2 or scale.shape != (weight.shape[0], weight.shape[1] // 32):
            raise ValueError(f"{name}: Engram table {tuple(weight.shape)} with scales {tuple(scale.shape)}; expected "
                             "[rows, dim] FP8 with [rows, dim / 32] UE8M0 scales")
        self.weight, self.scale, self.name = weight, scale, name

    @classmethod
    def open(cls, file: Path, name: str) -> EngramTable:
        return cls(_mapped(file, f"{name}.weight"), _mapped(file, f"{name}.scale"), name)

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """bf16 [*ids.shape, dim]: value * 2^(scale) per 32, computed in float32."""
        flat = ids.reshape(-1).cpu()
        values = self.weight[flat].float().unflatten(-1, (-1, 32)) * self.scale[flat].float().unsqueeze(-1)
        return values.flatten(-2).to(torch.bfloat16).view(*ids.shape, -1)


_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


def _mapped(file: Path, tensor: str) -> torch.Tensor:
    """A tensor of a safetensors file as a view of a private memory map (pages are read when touched)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        if tensor not in header:
            raise KeyError(tensor)
        entry = header[tensor]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: {tensor} is {entry['dtype']}; Engram tables are F8_E4M3 with F8_E8M0 scales")
        begin, end = entry["data_offsets"]
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=8 + length + begin)
    return raw.view(_DTYPES[entry["dtype"]]).view(*entry["shape"])
