"""The offline API: `LLM(model).generate(prompts, SamplingParams)`, drop-in for vLLM's."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from deepinfer.config import EngineArgs
from deepinfer.distributed.dp_engine import build_engine
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.multimodal.inputs import expand_placeholders
from deepinfer.multimodal.media import MediaPolicy
from deepinfer.multimodal.prompts import flatten_messages, process_sources, tokens_around_images
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer

logger = logging.getLogger("deepinfer")

PromptType = str | list[int] | dict


def default_model_path() -> Path:
    """The bundled default checkpoint shipped inside the package."""
    return Path(__file__).parent / "assets" / "default-model"


def resolve_model(model: str | Path | None) -> tuple[Path, bool]:
    """(checkpoint directory, whether it is the bundled default)."""
    if model is not None:
        path = Path(model)
        if not path.exists():
            raise ValueError(f"model path {str(model)!r} does not exist (deepinfer loads local checkpoints only)")
        return path, False
    path = default_model_path()
    if not (path / "config.json").exists():
        raise ValueError("no model given and the bundled default model is not installed; pass --model PATH")
    return path, True


def _salt(prompt: PromptType) -> str | None:
    """A dict prompt may carry `cache_salt`: prompts with different salts never share cached blocks."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


class LLM:
    def __init__(self, model: str | Path | None = None, tokenizer: str | Path | None = None,
                 allowed_local_media_path: str | None = None, **engine_options):
        """allowed_local_media_path: images may be file:// URLs of files inside this directory (vLLM's option)."""
        path, bundled = resolve_model(model)
        self.media = MediaPolicy(allowed_local_path=allowed_local_media_path, block_private=False)  # trusted caller
        if bundled:
            print(f"deepinfer: using the bundled default model ({path.name})")
        self.engine = build_engine(path, EngineArgs.from_kwargs(**engine_options))
        tok_dir = Path(tokenizer) if tokenizer else path
        self.tokenizer = Tokenizer.from_dir(tok_dir) if (tok_dir / "tokenizer.json").exists() else None
        self.model_dir = path  # chat: a template-less DSML checkpoint's format comes from its model_type
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker thread and rank processes (also at `with` exit, garbage collection and
        interpreter exit); idempotent."""
        self.engine.shutdown()

    def expert_load(self):
        """[MoE layers, experts] tokens routed over the last `eplb_window_size` steps, summed over the ranks
        (expert parallelism only; None otherwise). `eplb.stats.save_expert_load` writes it for `deepinfer eplb`."""
        executor = getattr(self.engine, "executor", None)
        return None if executor is None else executor.expert_load()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (blocks in use keep working)."""
        self.engine.reset_prefix_cache()

    # --- generate ------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """All prompts are validated before any runs, so a bad one raises ValueError and loses nothing."""
        items = self._normalise_prompts(prompts)
        params = self._normalise_params(sampling_params, len(items))
        prepared = [self._prepare(i, item) for i, item in enumerate(items)]
        for i, ((_, ids, images), p) in enumerate(zip(prepared, params)):
            self.engine.validate_request(f"prompt {i}", ids, p)
            self.engine.validate_images(f"prompt {i}", ids, tuple(images or ()), None)
        ids = [self._add(text, toks, p, (priority or [0] * len(items))[i], _salt(items[i]), images)
               for i, ((text, toks, images), p) in enumerate(zip(prepared, params))]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]], sampling_params=None, use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True):
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self._require_tokenizer()
        prompts = [self._chat_prompt(tok, c, add_generation_prompt, chat_template_kwargs or {})
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_prompt(self, tok: Tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> dict:
        """A conversation as a token-id prompt; image parts (image_url, image_pil) become placeholders with the
        images in multi_modal_data, as the server does."""
        flat, sources = flatten_messages(messages)
        text = chat_text(tok, self.model_dir, flat, add_generation_prompt, kwargs)
        if not sources:
            return {"prompt_token_ids": tok.encode(text, add_special_tokens=False), "prompt": text}
        image_token = self._vision()[1]
        ids = tokens_around_images(lambda piece, special: tok.encode(piece, add_special_tokens=special), text,
                                   len(sources), image_token, False)
        return {"prompt_token_ids": ids, "prompt": text, "multi_modal_data": {"image": sources}}

    def _vision(self):
        """(vision config, image token id); ValueError for a text-only model."""
        v41 = self.engine.model_config.v41
        if v41 is None or v41.vision is None:
            raise ValueError("this model takes no image inputs (its checkpoint has no vision tower)")
        return v41.vision, v41.image_token_id

    def stream(self, prompt: PromptType, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as tokens come (used by `deepinfer chat`)."""
        text, ids, images = self._prepare(0, prompt)
        rid = self._add(text, ids, params or SamplingParams(), 0, images=images)
        group = self.processor.groups[rid]
        while True:
            self._step()
            detok = group.samples[0].detok
            finished = group.finished
            if detok is not None:
                delta = detok.get_delta(finished)
                if delta:
                    yield delta
            if finished:
                return

    # --- internals -----------------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer

    @staticmethod
    def _normalise_prompts(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        return prompts

    @staticmethod
    def _normalise_params(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _prepare(self, index: int, item: PromptType) -> tuple[str | None, list[int], list | None]:
        """(text, token ids, image spans or None); a dict's multi_modal_data {"image": [...]} fills the image
        placeholders of its prompt (one image token id each), in order."""
        if isinstance(item, str):
            return item, self._require_tokenizer().encode(item), None
        if isinstance(item, dict):
            if "prompt_token_ids" in item:
                text, ids = item.get("prompt"), list(item["prompt_token_ids"])
            elif "prompt" in item:
                text, ids = item["prompt"], self._require_tokenizer().encode(item["prompt"])
            else:
                raise ValueError(f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            return (text, *self._with_images(ids, (item.get("multi_modal_data") or {}).get("image")))
        if isinstance(item, (list, tuple)):
            return None, list(item), None
        raise ValueError(f"prompt {index}: expected str, token id list or dict, got {type(item).__name__}")

    def _with_images(self, ids: list[int], images) -> tuple[list[int], list | None]:
        if not images:
            return ids, None
        cfg, image_token = self._vision()
        images = images if isinstance(images, (list, tuple)) else [images]
        return expand_placeholders(ids, process_sources(list(images), self.media, cfg), image_token)

    def _add(self, text: str | None, ids: list[int], params: SamplingParams, priority: int,
             cache_salt: str | None = None, images: list | None = None) -> str:
        rid = str(next(self._ids))
        requests = self.engine.add_request(rid, ids, params, priority, cache_salt=cache_salt,
                                           **({"images": images} if images else {}))
        self.processor.add(rid, text, ids, requests)
        return rid

    def _step(self) -> list[RequestOutput]:
        touched = self.engine.step()
        return self.processor.process(touched, self.engine.last_result, self.engine.abort)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or len(ids) < 2)
        while self.engine.has_unfinished:
            for out in self._step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]


def chat_text(tok: Tokenizer, model_dir: Path, messages: list[dict], add_generation_prompt: bool,
              kwargs: dict[str, Any]) -> str:
    """The chat template applied, or, for DSML checkpoints (V3.2 / V4 / V4.1) without a template for their
    format, DeepSeek's encoder, as the server renders it (server/tool_formats.py)."""
    from deepinfer.server.tool_formats import attach_format, render_prompt, uses_builtin_renderer

    fmt = getattr(tok, "tool_format", None) or attach_format(tok, None, model_dir)
    if uses_builtin_renderer(fmt, tok, messages, kwargs):
        return render_prompt(fmt, tok, messages, add_generation_prompt, kwargs)
    return tok.apply_chat_template(messages, add_generation_prompt, **kwargs)
