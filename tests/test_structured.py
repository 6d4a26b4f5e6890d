"""Structured outputs on the bundled model: generated JSON schemas, regexes and choices always hold, in
batches that mix constrained and unconstrained requests, with n > 1, preemption and prefix-cache hits;
bad specs raise before anything is queued; matchers roll back exactly."""

from __future__ import annotations

import json
import re
import string
import time
import types

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.structured import StructuredOutputsParams as Spec

FAST = settings(max_examples=4, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_TOKENS = 96
_IDENT = st.text(string.ascii_lowercase, min_size=1, max_size=6)
_WORD = st.text(string.ascii_letters + string.digits + " _-", min_size=1, max_size=8)


# --- generated JSON schemas ------------------------------------------------------------------------
def _integer(lo: int, span: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": lo + span}


def _number(lo: float, span: float) -> dict:
    return {"type": "number", "minimum": lo, "maximum": lo + span}


_LEAVES = st.one_of(
    st.builds(_integer, st.integers(-1000, 1000), st.integers(0, 1000)),
    st.builds(_number, st.integers(-100, 100).map(float), st.integers(1, 100).map(float)),
    st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
              st.integers(0, 3), st.integers(0, 8)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(_WORD, min_size=1, max_size=4, unique=True).map(lambda xs: {"enum": xs}),
    st.lists(st.integers(-50, 50), min_size=1, max_size=4, unique=True).map(lambda xs: {"enum": xs}),
)


def _array(items: dict, lo: int, extra: int) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + extra}


@st.composite
def _object(draw, children) -> dict:
    props = draw(st.dictionaries(_IDENT, children, min_size=1, max_size=4))
    required = [k for k in props if draw(st.booleans())]  # the others are optional
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def worst_case_bytes(s: dict) -> int:
    """An upper bound on the bytes (so on the tokens) of any compact JSON value `s` allows: strings count
    6 bytes per character (a \\uXXXX escape), numbers their bounds' digits plus 6 fraction digits."""
    if "enum" in s:
        return max(len(json.dumps(v)) for v in s["enum"])
    kind = s["type"]
    if kind == "object":
        return 2 + sum(len(k) + 6 + worst_case_bytes(v) for k, v in s["properties"].items())
    if kind == "array":
        return 2 + s["maxItems"] * (2 + worst_case_bytes(s["items"]))
    if kind == "string":
        return 2 + 6 * s["maxLength"]
    if kind in ("boolean", "null"):
        return 5
    digits = max(len(str(int(s["minimum"]))), len(str(int(s["maximum"]))))
    return digits + (7 if kind == "number" else 0)


SCHEMAS = st.recursive(_LEAVES, lambda children: st.one_of(st.builds(_array, children, st.integers(0, 1),
                                                                     st.integers(0, 2)), _object(children)),
                       max_leaves=6).flatmap(lambda s: _object(st.just(s)) if s.get("type") != "object" else st.just(s)
                                             ).filter(lambda s: worst_case_bytes(s) <= 400)


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=64 * 2**20, load_progress=False, max_num_seqs=64)


def _prompts(llm, n: int, what: str) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"{what} #{i}"}]) for i in range(n)]


def _params(i: int, spec: Spec | None, max_tokens: int) -> SamplingParams:
    """Alternating greedy and seeded sampling."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.9, seed=i, structured_outputs=spec)


@pytest.mark.slow
@FAST
@given(st.lists(SCHEMAS, min_size=30, max_size=30))
def test_generated_json_schemas_always_validate_in_mixed_batches(llm, schemas):
    """4 examples x 30 schemas = 120 schemas, each batch with 10 unconstrained requests among them. Every
    schema's outputs fit max_tokens (its worst case + EOS), so every output must complete and validate."""
    specs = [Spec(json=s) for s in schemas] + [None] * 10
    params = [_params(i, Spec(json=s), worst_case_bytes(s) + 1) for i, s in enumerate(schemas)]
    params += [_params(i, None, MAX_TOKENS) for i in range(10)]
    outs = llm.generate(_prompts(llm, len(specs), "Reply in JSON"), params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


REGEXES = st.one_of(
    st.builds(lambda a, b: rf"[a-z]{{{a},{a + b}}}", st.integers(1, 4), st.integers(0, 6)),
    st.builds(lambda n: rf"\d{{{n}}}-[A-Z]{{2}}", st.integers(1, 5)),
    st.builds(lambda w: "(" + "|".join(map(re.escape, w)) + r")( \d{1,3})?", st.lists(_IDENT, min_size=1, max_size=4)),
    st.just(r"(true|false|null)"), st.just(r"[0-9]{1,6}\.[0-9]{2}"), st.just(r"\w{1,8}@\w{1,8}\.(com|org)"),
)


@FAST
@given(st.lists(REGEXES, min_size=8, max_size=8), st.lists(st.lists(_WORD, min_size=1, max_size=5, unique=True),
                                                          min_size=8, max_size=8))
def test_regex_and_choice_always_match(llm, regexes, choices):
    """Bounded regexes (an unbounded one may legitimately run into max_tokens) and choices always match."""
    specs = [Spec(regex=r) for r in regexes] + [Spec(choice=c) for c in choices] + [None] * 4
    outs = llm.generate(_prompts(llm, len(specs), "Answer"), [_params(i, s, 48) for i, s in enumerate(specs)],
                        use_tqdm=False)
    for spec, out in zip(specs, outs):
        c = out.outputs[0]
        if spec is None:
            continue
        assert c.finish_reason == "stop", (spec, c.text)
        assert re.fullmatch(spec.regex, c.text) if spec.regex else c.text in spec.choice, (spec, c.text)


def test_n_samples_each_follow_the_grammar_with_their_own_matcher(llm):
    props = {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "w": {"enum": ["a", "b", "c"]}}
    spec = Spec(json={"type": "object", "properties": props, "required": ["n", "w"]})
    (out,) = llm.generate(_prompts(llm, 1, "JSON"), SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=64,
                                                                     structured_outputs=spec), use_tqdm=False)
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1  # the samples really differ
    for text in texts:
        jsonschema.validate(json.loads(text), spec.json)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
          "required": ["name", "tags"]}


def _greedy(llm_, prompts, spec=None, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=spec, **kw)
    return [o.outputs[0].text for o in llm_.generate(prompts, params, use_tqdm=False)]


def test_preemption_and_prefix_hits_keep_matchers_consistent(llm):
    """Greedy constrained outputs are the same with a cache so small that requests are preempted (and
    recompute their outputs), and when the prompt comes from the prefix cache."""
    prompts = [p + "x" * 40 for p in _prompts(llm, 6, "JSON please")]
    reference = _greedy(llm, prompts, Spec(json=SCHEMA))
    layout = llm.engine.layout
    budget = 6 * layout.bytes_per_slot + 12 * layout.bytes_per_block  # 12 blocks for six ~6-block requests
    tight = LLM(kv_cache_memory_bytes=budget, block_size=layout.block_size, max_num_seqs=6, load_progress=False)
    assert _greedy(tight, prompts, Spec(json=SCHEMA)) == reference
    assert tight.engine.scheduler.num_preemptions > 0
    hits_before = llm.engine.kv.prefix_hits
    assert _greedy(llm, prompts, Spec(json=SCHEMA)) == reference  # second run: prompts hit the prefix cache
    assert llm.engine.kv.prefix_hits > hits_before
    for text in reference:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_unfinishable_constraint_ends_with_length_and_a_finished_grammar_stops(llm):
    long = Spec(json={"type": "object", "properties": {"s": {"type": "string", "minLength": 50}}, "required": ["s"]})
    (out,) = llm.generate(_prompts(llm, 1, "x"), SamplingParams(max_tokens=5, structured_outputs=long), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    params = SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs=Spec(choice=["alpha", "beta"]))
    (out,) = llm.generate(_prompts(llm, 1, "x"), params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("alpha", "beta")


def test_reasoning_is_unconstrained_until_think_ends(llm):
    """With the gate closed (no `</think>` generated) the output is exactly the unconstrained one."""
    prompts = _prompts(llm, 3, "Think first")
    spec = Spec(regex="[0-9]", after_reasoning=True)
    think_end = llm.get_tokenizer().token_to_id("</think>")
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    gated = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec),
                         use_tqdm=False)
    for f, g in zip(free, gated):
        ids = f.outputs[0].token_ids
        cut = ids.index(think_end) + 1 if think_end in ids else len(ids)
        assert g.outputs[0].token_ids[:cut] == ids[:cut]
        if cut < len(ids):  # the answer after </think> is a digit
            assert re.fullmatch("[0-9]", llm.get_tokenizer().decode(g.outputs[0].token_ids[cut:]))


def test_constraint_applies_after_a_generated_think_end(llm, monkeypatch):
    """The bundled model never closes its reasoning by itself, so the 4th sampled token is forced to be
    `</think>` (by its logit); everything after it must follow the schema, everything before is free."""
    tok = llm.get_tokenizer()
    think_end = tok.token_to_id("</think>")
    original, calls = llm.engine.model.compute_logits, []

    def forced(hidden):
        logits = original(hidden)
        calls.append(1)
        if len(calls) == 4:
            logits[:, think_end] = 1e4
        return logits

    monkeypatch.setattr(llm.engine.model, "compute_logits", forced)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Think, then answer in JSON"}], thinking=True)
    spec = Spec(json=SCHEMA, after_reasoning=True)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, structured_outputs=spec),
                          use_tqdm=False)
    ids = out.outputs[0].token_ids
    assert ids.index(think_end) == 3 and out.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(tok.decode(ids[4:])), SCHEMA)
    assert not tok.decode(ids[:3]).startswith('{"')  # the reasoning was not constrained


@pytest.mark.parametrize("spec, reason", [
    (dict(json={"type": "objekt"}), "invalid JSON schema"),
    (dict(json='{"type": '), "not valid JSON"),
    (dict(regex="(unclosed"), "parenthesis"),
    (dict(grammar="root ::= missing"), "not defined"),
    (dict(json={"type": "string", "pattern": "(("}), "regex"),
])
def test_bad_specs_raise_before_anything_is_queued(llm, spec, reason):
    with pytest.raises(ValueError, match=reason):
        llm.generate(["fine", "also fine"], [SamplingParams(), SamplingParams(structured_outputs=spec)])
    assert not llm.engine.has_unfinished


def test_spec_shape_errors():
    with pytest.raises(ValueError, match="exactly one"):
        Spec(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        Spec()
    with pytest.raises(ValueError, match="unknown structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == Spec(regex="a+")
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=Spec(regex="a+"))


def test_compile_time_limit_fails_only_that_request(llm, monkeypatch):
    manager = llm.engine._structured_manager()
    slow = lambda grammar: time.sleep(2.0)
    monkeypatch.setattr(manager.compiler, "compile", slow)
    monkeypatch.setattr(manager, "timeout_s", 0.05)
    unique = Spec(regex="[a-z]{7}slow")  # not in the compiled-grammar cache
    params = [SamplingParams(max_tokens=4), SamplingParams(structured_outputs=unique)]
    outs = llm.generate(_prompts(llm, 2, "x"), params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "error" and "did not compile" in outs[1].outputs[0].stop_reason
    assert not llm.engine.has_unfinished and llm.engine.kv.num_free_blocks == llm.engine.layout.num_blocks


def test_unconstrained_steps_build_no_bitmask(llm):
    engine = llm.engine
    llm.generate(_prompts(llm, 2, "x"), SamplingParams(max_tokens=3), use_tqdm=False)
    assert engine.last_scheduled.grammar_bitmask is None


def test_compiled_grammars_are_cached_by_spec(llm):
    manager = llm.engine._structured_manager()
    spec = Spec(json={"type": "object", "properties": {"cached": {"type": "boolean"}}, "required": ["cached"]})
    llm.generate(_prompts(llm, 1, "x"), SamplingParams(max_tokens=16, structured_outputs=spec), use_tqdm=False)
    before = manager.num_compiles
    llm.generate(_prompts(llm, 3, "x"), SamplingParams(max_tokens=16, structured_outputs=spec), use_tqdm=False)
    assert manager.num_compiles == before


def test_matcher_rollback_is_exact(llm):
    """What speculative decoding needs: accept drafts, roll back the rejected ones, continue identically."""
    manager = llm.engine._structured_manager()
    tok = llm.get_tokenizer()
    state = manager.request_state(Spec(json={"type": "object", "properties": {"k": {"type": "string"}}}))
    while not state.ready():
        time.sleep(0.01)
    ids = tok.encode('{"k": "abc"}', add_special_tokens=False)
    assert all(state.accept(t) for t in ids[:3])
    assert state.valid_prefix(ids[3:]) == len(ids) - 3 and state.num_observed == 3
    state.rollback(2)
    assert all(state.accept(t) for t in ids[1:]) and state.matcher.is_completed()
    assert state.valid_prefix(tok.encode("}}", add_special_tokens=False)) == 0


def test_draft_masks_are_the_masks_after_each_draft(llm):
    """A request verifying drafts gets one mask row per position: row j equals the mask after accepting
    drafts[:j] one by one; the matcher is back where it was afterwards."""
    manager = llm.engine._structured_manager()
    tok = llm.get_tokenizer()
    spec = Spec(json={"type": "object", "properties": {"k": {"type": "string"}}})
    state, reference = manager.request_state(spec), manager.request_state(spec)
    while not (state.ready() and reference.ready()):
        time.sleep(0.01)
    ids = tok.encode('{"k": "abc"}', add_special_tokens=False)
    budget = {"max_output_tokens": 100, "output_token_ids": []}  # far from the end: the grammar's own masks
    req = types.SimpleNamespace(request_id="r", grammar=state, **budget)
    keys, masks = manager.fill([req], {"r": ids[:3]})
    assert keys == ["r"] * 4 and state.num_observed == 0
    for j in range(4):
        _, expected = manager.fill([types.SimpleNamespace(request_id="r", grammar=reference, **budget)])
        assert torch.equal(masks[j], expected[0])
        if j < 3:
            assert reference.accept(ids[j])
    assert all(state.accept(t) for t in ids)  # the fill left the matcher at the start


def test_rollback_across_the_reasoning_gate(llm):
    manager = llm.engine._structured_manager()
    tok = llm.get_tokenizer()
    state = manager.request_state(Spec(choice=["yes"], after_reasoning=True))
    while not state.ready():
        time.sleep(0.01)
    think = tok.encode("hmm", add_special_tokens=False) + [manager.think_end_id]
    assert all(state.accept(t) for t in think) and state.constrains_next
    assert not state.accept(tok.encode("no", add_special_tokens=False)[0])
    state.rollback(1)  # the </think> itself: unconstrained again
    assert not state.constrains_next and state.accept(tok.encode("no", add_special_tokens=False)[0])


def test_bitmask_application_matches_xgrammar():
    import xgrammar as xgr

    from deepinfer.worker.sampler import apply_token_bitmask

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 100, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    ours = apply_token_bitmask(logits.clone(), torch.tensor([0, 2]), bitmask)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, torch.cat([bitmask[:1], torch.full_like(bitmask[:1], -1), bitmask[1:]]))
    assert torch.equal(ours, theirs)


def test_cli_generate_with_a_schema_file_and_a_bad_regex(tmp_path, capsys):
    from deepinfer import cli

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    base = ["generate", "--json", "--max-tokens", "16", "--kv-cache-memory-bytes", str(16 * 2**20),
            "--no-load-progress", "--chat", "Answer in JSON"]
    assert cli.main([*base, "--json-schema", str(tmp_path / "schema.json")]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    jsonschema.validate(json.loads(line["text"]), schema)
    assert cli.main([*base, "--regex", "(oops"]) == cli.EXIT_ERROR
    assert "parenthesis" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [{"async_scheduling": True},
                                  pytest.param({"deterministic": True}, marks=pytest.mark.slow)])
def test_async_and_deterministic_modes_constrain_too(llm, mode):
    """Async scheduling resolves a step's masks after the previous step's tokens reach the matchers: its
    greedy outputs equal synchronous scheduling's. Deterministic mode samples row by row, each with its mask."""
    prompts = _prompts(llm, 6, "JSON please")
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=Spec(json=SCHEMA) if i % 3 else None)
              for i in range(6)]
    reference = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    other = LLM(kv_cache_memory_bytes=32 * 2**20, load_progress=False, **mode)
    texts = [o.outputs[0].text for o in other.generate(prompts, params, use_tqdm=False)]
    for p, text in zip(params, texts):
        if p.structured_outputs is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
    if "async_scheduling" in mode:
        assert texts == reference
    assert not other.engine.has_unfinished
