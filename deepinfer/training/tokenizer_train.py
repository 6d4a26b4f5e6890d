"""Trains a DeepSeek-style byte-level BPE tokenizer on the corpus' train split and saves it HF-style.

Invariants of the saved tokenizer:
  * ids 0..15 are SPECIAL_TOKENS in that order; the 256 byte symbols and the merges follow;
  * byte-level with the full 256-symbol alphabet and no normalizer: decode(encode(text)) == text for every str;
  * the post-processor prepends BOS (as DeepSeek's tokenizer.json does) for users of raw `tokenizers` and of
    transformers' AutoTokenizer; `deepinfer.tokenizer.Tokenizer` encodes without it and adds BOS itself
    (add_bos_token), so either way a sequence starts with exactly one BOS;
  * BOS/EOS/pad/User/Assistant are special (dropped by decode(skip_special_tokens=True)); the think and tool
    markers are added tokens with special=False, so they survive decoding, as in DeepSeek's tokenizers;
  * training is deterministic: the same corpus and arguments give a byte-identical tokenizer.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from deepinfer.training.corpus import iter_documents

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
TOOL_MARKERS = (
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, THINK, END_THINK, *TOOL_MARKERS)  # token id == index
VISIBLE_TOKENS = frozenset({THINK, END_THINK, *TOOL_MARKERS})  # added with special=False
DEFAULT_VOCAB_SIZE = 8192  # counts the added tokens and the 256 byte symbols
DEFAULT_MAX_LENGTH = 4096
MIN_FREQUENCY = 2

# DeepSeek-V3.1's prompt format (written from scratch, same output):
#   BOS + system prompts joined by "\n\n"
#   user:       <｜User｜>{content}
#   assistant:  <｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>   (reasoning "...</think>" dropped), except
#               after the last user message (the reply being trained on), which keeps its reasoning:
#               <｜Assistant｜><think>{reasoning}</think>{answer}<｜end▁of▁sentence｜>
#               tool_calls append <｜tool▁calls▁begin｜>(<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}
#               <｜tool▁call▁end｜>)*<｜tool▁calls▁end｜> before EOS; after tool outputs no <｜Assistant｜>.
#   tool:       <｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜>
#   generation prompt (only right after a user message): <｜Assistant｜> + <think> if thinking else </think>
# Every tag strips surrounding whitespace ("-"), so the layout below never leaks into the output.
CHAT_TEMPLATE = """
{%- if thinking is not defined -%}
  {%- set thinking = enable_thinking if enable_thinking is defined else false -%}
{%- endif -%}
{%- set ns = namespace(system='', last_user=-1, after_user=false) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {%- set ns.system = ns.system ~ ('\\n\\n' if ns.system else '') ~ m.content -%}
  {%- elif m.role == 'user' -%}
    {%- set ns.last_user = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{{- (bos_token if bos_token is defined else '') ~ ns.system -}}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {{- '<｜User｜>' ~ m.content -}}
    {%- set ns.after_user = true -%}
  {%- elif m.role == 'assistant' -%}
    {%- set answer = m.content or '' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is defined else none -%}
    {%- if reasoning is none and '</think>' in answer -%}
      {%- set reasoning = answer.split('</think>', 1)[0] -%}
      {%- set answer = answer.split('</think>', 1)[1] -%}
    {%- endif -%}
    {%- if reasoning is not none and reasoning.startswith('<think>') -%}
      {%- set reasoning = reasoning[7:] -%}
    {%- endif -%}
    {%- if ns.after_user -%}
      {{- '<｜Assistant｜>' -}}
    {%- endif -%}
    {%- if reasoning is not none and loop.index0 > ns.last_user -%}
      {{- '<think>' ~ reasoning ~ '</think>' -}}
    {%- elif ns.after_user -%}
      {{- '</think>' -}}
    {%- endif -%}
    {{- answer -}}
    {%- if m.tool_calls -%}
      {{- '<｜tool▁calls▁begin｜>' -}}
      {%- for call in m.tool_calls -%}
        {%- set fn = call.function if call.function is defined else call -%}
        {%- set args = fn.arguments if fn.arguments is string else fn.arguments | tojson -%}
        {{- '<｜tool▁call▁begin｜>' ~ fn.name ~ '<｜tool▁sep｜>' ~ args ~ '<｜tool▁call▁end｜>' -}}
      {%- endfor -%}
      {{- '<｜tool▁calls▁end｜>' -}}
    {%- endif -%}
    {{- '<｜end▁of▁sentence｜>' -}}
    {%- set ns.after_user = false -%}
  {%- elif m.role == 'tool' -%}
    {{- '<｜tool▁output▁begin｜>' ~ m.content ~ '<｜tool▁output▁end｜>' -}}
    {%- set ns.after_user = false -%}
  {%- elif m.role != 'system' -%}
    {{- raise_exception('unsupported role: ' ~ m.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.after_user -%}
  {{- '<｜Assistant｜>' ~ ('<think>' if thinking else '</think>') -}}
{%- endif -%}
"""


def train_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, max_bytes: int | None = None,
                    model_max_length: int = DEFAULT_MAX_LENGTH) -> Path:
    """Trains on the corpus train split (its first max_bytes bytes if given); writes tokenizer.json and
    tokenizer_config.json into out_dir, which `deepinfer.tokenizer.Tokenizer.from_dir` loads. Returns out_dir."""
    tokenizer = train_bpe(iter_documents("train", max_bytes=max_bytes), vocab_size)
    return save_tokenizer(tokenizer, out_dir, model_max_length)


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> HFTokenizer:
    tokenizer = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=MIN_FREQUENCY, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),  # the trainer puts these first: ids 0..15 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # all 256 bytes, seen in training or not
    tokenizer.train_from_iterator(texts, trainer)
    _mark_visible_tokens(tokenizer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))])
    return tokenizer


def _empty_tokenizer() -> HFTokenizer:
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _mark_visible_tokens(tokenizer: HFTokenizer) -> None:
    # Re-adding an existing added token updates its flags and keeps its id.
    tokens = [AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS if t in VISIBLE_TOKENS]
    tokenizer.add_tokens(tokens)


def tokenizer_config(model_max_length: int = DEFAULT_MAX_LENGTH) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE.strip(),
    }


def save_tokenizer(tokenizer: HFTokenizer, out_dir: str | Path,
                   model_max_length: int = DEFAULT_MAX_LENGTH) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = json.dumps(tokenizer_config(model_max_length), ensure_ascii=False, indent=2)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return out_dir
