"""The xgrammar backend: tokenizer info from our `tokenizers` tokenizer, spec -> grammar (validation),
grammar -> compiled grammar, and bitmask helpers. The only module that imports xgrammar."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from deepinfer.structured.params import StructuredOutputsParams, check_json_schema

_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _CPP_PREFIX.sub("", str(exc).strip())


def _vocab_type(tokenizer) -> xgr.VocabType:
    spec = json.loads(tokenizer.inner.to_str())
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    if any(d.get("type") == "ByteLevel" for d in parts):
        return xgr.VocabType.BYTE_LEVEL
    if (spec.get("model") or {}).get("byte_fallback"):
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


# Special tokens that are part of text the model writes (DeepSeek V3.2+ mark ｜DSML｜, the prefix of every
# tool-call tag, special): grammars spelling that text must be able to produce the token.
MARKUP_SPECIAL_TOKENS = frozenset({"｜DSML｜"})


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """Token i of the model's vocabulary as xgrammar sees it. Special tokens other than the stop tokens and
    MARKUP_SPECIAL_TOKENS, and ids past the tokenizer's vocabulary (padding rows of the LM head), are encoded
    as "" so xgrammar never allows them inside constrained text."""
    encoded = [""] * vocab_size
    for token, i in tokenizer.inner.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and (i not in tokenizer.special_token_ids or i in stop_token_ids
                               or token in MARKUP_SPECIAL_TOKENS):
            encoded[i] = token
    return xgr.TokenizerInfo(encoded, _vocab_type(tokenizer), vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids))


# --- spec -> grammar (tokenizer-independent; this is where bad input is caught) ---------------------
def _json_grammar(schema) -> xgr.Grammar:
    check_json_schema(schema)
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)


def _choice_grammar(choices: list[str]) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


_BUILDERS = {
    "json": lambda spec: _json_grammar(spec.schema),
    "json_object": lambda spec: _json_grammar({"type": "object"}),
    "regex": lambda spec: xgr.Grammar.from_regex(spec.regex),
    "choice": lambda spec: _choice_grammar(list(spec.choice)),
    "grammar": lambda spec: xgr.Grammar.from_ebnf(spec.grammar),
    "structural_tag": lambda spec: xgr.Grammar.from_structural_tag(spec.structural_tag),
}


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The spec's grammar, or ValueError naming what is wrong with the schema / regex / grammar."""
    try:
        return _BUILDERS[spec.kind](spec)
    except ValueError:
        raise
    except Exception as e:  # xgrammar reports bad input as RuntimeError (or its own error types)
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')} constraint: {reason(e)}") from None


class Compiler:
    """Compiles grammars against one tokenizer (thread-safe; xgrammar releases the GIL while compiling)."""

    def __init__(self, info: xgr.TokenizerInfo, max_threads: int = 2, cache_bytes: int = 0):
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=cache_bytes > 0,
                                             cache_limit_bytes=cache_bytes if cache_bytes > 0 else -1)

    def compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        """The compiled grammar; ValueError when its language is empty (no output can ever match)."""
        compiled = self._compiler.compile_grammar(grammar)
        if not allows_any_token(new_matcher(compiled), self.info.vocab_size):
            raise ValueError("no output can match it (the first token already has no allowed choice)")
        return compiled


def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(compiled)


def allows_any_token(matcher: xgr.GrammarMatcher, vocab_size: int) -> bool:
    """Some token is allowed next (EOS counts: a complete grammar allows it). For a fresh matcher False
    means no output can match: the language is empty, or none of its first characters has a token."""
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    words, rest = divmod(vocab_size, 32)
    return bool(bitmask[0, :words].any()) or bool(rest and int(bitmask[0, words]) & ((1 << rest) - 1))


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(V / 32)]; bit j of word w allows token 32 w + j. Starts all-allowed."""
    return xgr.allocate_token_bitmask(rows, vocab_size)
