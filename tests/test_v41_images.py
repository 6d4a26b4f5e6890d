"""DeepSeek-V4.1 image inputs against DeepSeek's reference code (tests/golden/v41/v: a tiny seeded V4.1 with a
2-layer vision tower; one and two images, an image right after BOS, images stretched, padded, upscaled and shrunk).

Checked bit for bit: the image processor's patches and grids, the ViT and aligner outputs, and every step's logits
of greedy generation, on the reference's schedule and on the engine's others (ragged batches with chunk
boundaries moved around the image spans, prefix-cache hits, n > 1, preemption).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from v41_golden import GOLDEN, golden_threads, load_golden, run_to_end  # noqa: F401  (autouse: the goldens' threads)

from deepinfer import LLM, SamplingParams
from deepinfer.multimodal.image_processor import ImageError, preprocess

V = GOLDEN / "v"
LOGIT_TOL = 1e-4  # as for the text goldens; measured 0.0


@pytest.fixture(scope="module")
def golden():
    return load_golden("v")


def _images(g: dict, i: int) -> list[Image.Image]:
    return [Image.open(V / img["file"]) for img in g["prompts"][i]["images"]]


def _llm(**options) -> LLM:
    return LLM(str(V), load_progress=False, **options)


def _run(llm: LLM, g: dict, which: list[int], n: int = 1):
    """Greedy tokens and each sampled row's log-probs [vocab] by request id, through the engine's own steps."""
    steps = len(g["tracks"]["fixed"]["tokens"][0])
    for i in which:
        ids, spans = llm._with_images(list(g["prompts"][i]["ids"]), _images(g, i))
        assert ids == g["prompts"][i]["input_ids"]
        llm.engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, n=n),
                               images=spans)
    return run_to_end(llm)


def _check(g: dict, tensors: dict, tokens: dict, rows: dict, rid: str, i: int) -> float:
    assert tokens[rid] == g["tracks"]["fixed"]["tokens"][i], f"prompt {i}"
    ref = tensors[f"fixed.p{i}.logits"].log_softmax(-1)
    assert len(rows[rid]) == len(ref)
    return max((lp - ref[s]).abs().max().item() for s, lp in enumerate(rows[rid]))


def test_processor_and_encoder_match_the_reference(golden):
    g, tensors = golden
    llm = _llm(enable_prefix_caching=False)
    cfg = llm.engine.model_config.v41.vision
    for name, meta in g["images"].items():
        img = preprocess(Image.open(V / meta["file"]), cfg)
        assert (img.n_vit_h, img.n_vit_w, img.n_llm_h, img.n_llm_w) == \
            (meta["n_vit_h"], meta["n_vit_w"], meta["n_llm_h"], meta["n_llm_w"]), name
        assert torch.equal(img.patches, tensors[f"image.{name}.patches"]), name
        model = llm.engine.model
        with torch.inference_mode():
            vit = model.vision(img.patches, img.n_vit_h, img.n_vit_w)
            encoded = model.encode_image(img.patches, img.n_vit_h, img.n_vit_w)
        assert torch.equal(vit, tensors[f"image.{name}.vit"]), name
        assert torch.equal(encoded, tensors[f"image.{name}.encoded"]), name


def test_reference_schedule_matches_deepseek_reference(golden):
    g, tensors = golden
    llm = _llm(max_num_seqs=1, enable_prefix_caching=False)
    for i in range(len(g["prompts"])):
        tokens, rows = _run(llm, g, [i])
        assert _check(g, tensors, tokens, rows, str(i), i) <= LOGIT_TOL
    # the images matter: the same spans as plain image tokens give other tokens in the reference
    assert g["tracks"]["fixed"]["tokens"][1] != g["text_only"]["tokens"]


@pytest.mark.parametrize("budget", [48, 64])
def test_ragged_chunked_batches_match(golden, budget):
    """All prompts at once with a small token budget: chunks end before image spans (48: most chunks are cut
    short of the budget) and the batch mixes prefill chunks with decodes."""
    g, tensors = golden
    llm = _llm(max_num_batched_tokens=budget, enable_prefix_caching=False)
    tokens, rows = _run(llm, g, [0, 1, 2, 3])
    assert max(_check(g, tensors, tokens, rows, str(i), i) for i in range(4)) <= LOGIT_TOL
    assert llm.engine.runner.encoder.images_encoded == 5  # one encoder run per image


def test_prefix_cache_hits_by_image_and_never_across_images(golden):
    g, tensors = golden
    llm = _llm(max_num_seqs=1, block_size=16)
    first = _run(llm, g, [1])
    kv = llm.engine.kv
    hits_before = kv.prefix_hits
    tokens, rows = _run(llm, g, [1])  # the same images: a hit, and the encoder cache serves the replay
    assert kv.prefix_hits > hits_before and tokens == first[0]
    assert _check(g, tensors, tokens, rows, "1", 1) <= LOGIT_TOL
    assert llm.engine.runner.encoder.images_encoded == 2
    # the same token layout with another image of the same grid: no block past the text before it is shared
    ids = list(g["prompts"][1]["ids"])
    other = [Image.open(V / "images" / "wide.png").transpose(Image.Transpose.FLIP_LEFT_RIGHT), _images(g, 1)[1]]
    ids, spans = llm._with_images(ids, other)
    assert ids == g["prompts"][1]["input_ids"]
    before = kv.prefix_hits
    llm.engine.add_request("other", ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), images=spans)
    out = {}
    while llm.engine.has_unfinished:
        for req in llm.engine.step():
            out[req.request_id] = req.output_token_ids
    assert kv.prefix_hits - before < spans[0].offset + 16 and out["other"] != first[0]["1"]


def test_n_samples_and_preemption_reuse_the_encoded_image(golden):
    g, tensors = golden
    llm = _llm(enable_prefix_caching=False, max_num_seqs=4, block_size=16, kv_cache_memory_bytes=120_000)  # preempts
    tokens, rows = _run(llm, g, [0, 1, 3], n=2)
    for i in (0, 1, 3):
        for rid in (f"{i}-0", f"{i}-1"):
            assert _check(g, tensors, tokens, rows, rid, i) <= LOGIT_TOL
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.encoder.images_encoded == 4 and llm.engine.runner.encoder.cache_hits > 0


def test_offline_chat_and_generate_take_images(golden):
    g, _ = golden
    llm = _llm(enable_prefix_caching=False, allowed_local_media_path=str(V / "images"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": g["prompts"][0]["ids"], "multi_modal_data": {"image": _images(g, 0)}},
                       params)
    assert out[0].outputs[0].token_ids == g["tracks"]["fixed"]["tokens"][0]
    url = (V / "images" / "plain.png").resolve().as_uri()
    chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "the cat"},
                                                  {"type": "image_url", "image_url": {"url": url}}]}], params)
    assert len(chat[0].outputs[0].token_ids) == 12 and chat[0].prompt_token_ids.count(510) > 1


def test_bad_image_inputs_are_refused_and_queue_nothing(golden, tmp_path):
    g, _ = golden
    llm = _llm(max_num_batched_tokens=32)
    ids = list(g["prompts"][1]["ids"])
    with pytest.raises(ImageError, match="2 image placeholders but 1 images"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": _images(g, 1)[:1]}})
    with pytest.raises(ValueError, match="does not fit one step"):  # tall.png's 37 tokens > 32
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": _images(g, 1)}})
    with pytest.raises(ValueError, match="image tokens .* but no images"):
        llm.generate({"prompt_token_ids": g["prompts"][1]["input_ids"]})
    (tmp_path / "x.png").write_bytes(b"not a png")
    with pytest.raises(ImageError, match="disabled"):
        llm.generate({"prompt_token_ids": [5, 510], "multi_modal_data": {"image": [(tmp_path / "x.png").as_uri()]}})
    with pytest.raises(ImageError, match="not an image"):
        llm.generate({"prompt_token_ids": [5, 510], "multi_modal_data": {"image": [b"not a png"]}})
    assert not llm.engine.has_unfinished and llm.engine.kv.num_free_blocks == llm.engine.layout.num_blocks


def test_text_only_models_refuse_images():
    llm = LLM(str(GOLDEN / "a"), load_progress=False)
    with pytest.raises(ValueError, match="no image inputs"):
        llm.generate({"prompt_token_ids": [5, 510], "multi_modal_data": {"image": [Image.new("RGB", (8, 8))]}})
