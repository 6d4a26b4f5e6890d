"""Budget-aware constrained decoding: a constrained output that still has the budget to finish always
finishes, valid and with finish_reason "stop", instead of running out of tokens mid-structure.

Unit tests of the closing search (deepinfer/structured/closing.py) on generated schemas and random grammar
states, then the bundled model offline at temperature 1 with small max_tokens."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.llm import default_model_path
from deepinfer.structured import StructuredOutputsParams
from deepinfer.structured.closing import ClosingPlan
from deepinfer.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with unbounded numbers, strings and arrays (what makes outputs run long)."""
    kinds = ["integer", "number", "string", "boolean", "array"] + (["object"] if depth < 2 else [])
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        if kind == "array":
            props[f"k{i}"] = {"type": "array", "items": {"type": rng.choice(["integer", "string"])}}
        elif kind == "object":
            props[f"k{i}"] = random_schema(rng, depth + 1)
        else:
            props[f"k{i}"] = {"type": kind}
    required = sorted(rng.sample(sorted(props), rng.randint(1, len(props))))
    return {"type": "object", "properties": props, "required": required}


SCHEMAS = [random_schema(random.Random(seed)) for seed in range(6)]


@pytest.fixture(scope="module")
def manager():
    from deepinfer.structured.manager import StructuredOutputManager

    tok = Tokenizer.from_dir(default_model_path())
    return StructuredOutputManager(tok, tok.vocab_size, [tok.eos_token_id])


def _matcher(manager, schema: dict):
    spec = StructuredOutputsParams(json=schema)
    return xgr.GrammarMatcher(manager.compiler.compile(manager.validate(spec)))


def _random_walk(manager, matcher, rng: random.Random, steps: int) -> None:
    """Advance `matcher` by up to `steps` random allowed tokens (never the stop token)."""
    mask = torch.zeros(1, (manager.vocab_size + 31) // 32, dtype=torch.int32)
    stop = set(manager.closer.stop_token_ids)
    for _ in range(steps):
        matcher.fill_next_token_bitmask(mask, 0)
        allowed = [t for t in range(manager.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1 and t not in stop]
        if not allowed:
            return
        assert matcher.accept_token(rng.choice(allowed))


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_closing_completes_from_random_states(manager, schema):
    """From any state a random walk reaches, the closing tokens complete the grammar, the stop token is
    allowed after them, and the matcher itself is left where it was."""
    rng = random.Random(json.dumps(schema))
    for _ in range(8):
        m = _matcher(manager, schema)
        _random_walk(manager, m, rng, rng.randint(0, 24))
        before = m.fork()
        tokens = manager.closer.closing(m)
        assert tokens is not None
        assert all(m.accept_token(t) for t in tokens) and m.is_completed()
        assert m.accept_token(manager.closer.stop_token_ids[0]) and m.is_terminated()
        assert before.is_completed() == (tokens == [])


def test_closing_plan_forces_only_inside_the_window(manager):
    m = _matcher(manager, SCHEMAS[0])
    plan = ClosingPlan(manager.closer, margin=3)
    need = plan.need(m)
    assert need is not None and need >= 2  # at least one content token and the stop token
    assert plan.forced(m, need + 4) is None  # far from the end: the grammar alone decides
    assert plan.forced(m, need + 3) == plan.forced(m, need) == plan.tokens[:1]
    assert plan.forced(m, need - 1) is None  # too late to close: nothing to force


def test_cached_closing_follows_the_forced_tokens(manager):
    m = _matcher(manager, SCHEMAS[1])
    plan = ClosingPlan(manager.closer, margin=0)
    need = plan.need(m)
    for left in range(need, 1, -1):
        (token,) = plan.forced(m, left)
        assert m.accept_token(token)
        assert plan.need(m) == left - 1  # the cached tail is reused, never longer
    assert plan.forced(m, 1) == manager.closer.stop_token_ids


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory_bytes=64 * 2**20, max_num_seqs=16)


@pytest.mark.parametrize("slack", [0, 3, 12])
def test_sampled_outputs_close_within_small_budgets(llm, manager, slack):
    """Temperature 1, budgets from exactly the closing need up: every output parses, follows its schema and
    ends with "stop" (without budget-awareness most of these end by length mid-number or mid-string)."""
    prompts = ["import json\nconfig = ", "def load(path):\n    return "]
    for i, schema in enumerate(SCHEMAS):
        budget = ClosingPlan(manager.closer, 0).need(_matcher(manager, schema)) + slack
        params = SamplingParams(temperature=1.0, max_tokens=budget, n=3, seed=i,
                                structured_outputs=StructuredOutputsParams(json=schema))
        for out in llm.generate(prompts, params):
            for c in out.outputs:
                assert c.finish_reason == "stop", (schema, budget, c.text)
                jsonschema.validate(json.loads(c.text), schema)
                assert len(c.token_ids) <= budget


def test_draft_rows_near_the_end_force_the_closing_at_each_position(manager):
    """Speculative verification near the end of the budget: row j (after drafts[:j]) allows only the
    closing token for that position, and the fill leaves the matcher where it was."""
    import types

    from deepinfer.structured.manager import RequestGrammar

    schema = SCHEMAS[2]
    compiled = manager.compiler.compile(manager.validate(StructuredOutputsParams(json=schema)))
    future = types.SimpleNamespace(done=lambda: True, cancelled=lambda: False, result=lambda: compiled)
    grammar = RequestGrammar(StructuredOutputsParams(json=schema), future, 30.0, None,
                             ClosingPlan(manager.closer, margin=0))
    assert grammar.ready()
    closing = manager.closer.closing(grammar.matcher)
    req = types.SimpleNamespace(request_id="r", grammar=grammar, max_output_tokens=len(closing) + 1,
                                output_token_ids=[])
    keys, masks = manager.fill([req], {"r": closing[:2]})
    assert keys == ["r"] * 3
    for j in range(3):
        allowed = [t for t in range(manager.vocab_size) if (int(masks[j, t // 32]) >> (t % 32)) & 1]
        assert allowed == [closing[j]]
    assert grammar.num_fed == 0 and all(grammar.accept(t) for t in closing)
