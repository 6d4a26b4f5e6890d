"""Prefill/decode disaggregation at the engine level: a prefill EngineCore and a decode EngineCore in one
process, over the local and Mooncake transports, against a colocated engine (greedy, fp32)."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
from tiny_models import make_reference, save_reference

from deepinfer.config import EngineArgs
from deepinfer.disagg import plan as plan_mod
from deepinfer.disagg.dlslime import load_dlslime
from deepinfer.disagg.layout import LayoutMismatch, check_compatible, describe
from deepinfer.disagg.mooncake import load_engine
from deepinfer.disagg.plan import Side, Span, merged, plan_reads
from deepinfer.disagg.transport import LocalTransport
from deepinfer.engine.core import EngineCore
from deepinfer.layers.metadata import CacheTensorSpec
from deepinfer.llm import resolve_model
from deepinfer.request import RequestStatus
from deepinfer.sampling_params import SamplingParams


def _missing(load) -> str | None:
    """Why a transport cannot load here (its wheel or Debian's libibverbs1 missing), or None."""
    try:
        load()
    except ImportError as e:
        return str(e)
    return None


# Their tests skip with these reasons; the local transport's still run.
MISSING = {"local": None, "mooncake": _missing(load_engine), "dlslime": _missing(load_dlslime)}
MOONCAKE_MISSING = MISSING["mooncake"]

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
COMMON = dict(max_num_seqs=8, kv_cache_memory_bytes=48 << 20, load_progress=False, dtype="float32",
              max_num_batched_tokens=256)


# --- the pure parts ---------------------------------------------------------------------------------
def _layout(window: int, digest: str = "m", dtype="float32", paged_rows: int = 8):
    specs = [CacheTensorSpec("l0.window", "state", (window, 4), getattr(__import__("torch"), dtype)),
             CacheTensorSpec("l0.entries", "paged", (2, 4), getattr(__import__("torch"), dtype))]
    return describe(specs, paged_rows, 3, 8, digest)


def test_rings_map_by_position_and_only_live_rows_travel():
    decode, prefill = _layout(window=6), _layout(window=4)  # the decode side keeps 2 more rows (drafts)
    spans = plan_reads(decode, prefill, 10, Side([5, 6], 2), Side([1, 2], 0))
    ring = [s for s in spans if s.name == "l0.window"]
    # the last min(10, 4, 6) = 4 positions, 6..9: decode rows (2 * 6 + p % 6), prefill rows (0 * 4 + p % 4)
    # positions 6..9 sit in decode rows 12..15 (one run) and prefill rows 2, 3, 0, 1 (two runs)
    assert [(s.local_offset // 16, s.remote_offset // 16, s.nbytes // 16) for s in ring] == [(12, 2, 2), (14, 0, 2)]
    paged = [s for s in spans if s.name == "l0.entries"]
    assert [(s.local_offset // 32, s.remote_offset // 32) for s in paged] == [(5, 1)]  # merged: 5,6 <- 1,2
    assert paged[0].nbytes == 2 * 32


def test_a_prefix_hit_on_the_decode_side_skips_its_blocks():
    decode, prefill = _layout(4), _layout(4)
    full = plan_reads(decode, prefill, 20, Side([3, 5, 7], 0), Side([0, 1, 2], 1))
    hit = plan_reads(decode, prefill, 20, Side([3, 5, 7], 0), Side([0, 1, 2], 1), skip_blocks=2)
    assert plan_mod.total_bytes(full) - plan_mod.total_bytes(hit) == 2 * 32


def test_merge_joins_only_runs_contiguous_on_both_sides():
    spans = [Span("a", 0, 0, 4), Span("a", 4, 4, 4), Span("a", 8, 100, 4), Span("b", 12, 104, 4)]
    assert merged(spans) == [Span("a", 0, 0, 8), Span("a", 8, 100, 4), Span("b", 12, 104, 4)]


@pytest.mark.parametrize("decode, message", [
    (_layout(4, digest="other"), "model configs differ"),
    (_layout(4, dtype="bfloat16"), "start both with the same --dtype and --kv-cache-dtype"),
    ({**_layout(4), "components": {**_layout(4)["components"], "mtp.0.window": {
        "kind": "state", "shape": [4, 4], "dtype": "float32", "rows": 3}}}, "does not compute"),
    ({**_layout(4), "block_size": 16}, "block sizes differ"),
])
def test_mismatched_layouts_are_refused_with_what_differs(decode, message):
    with pytest.raises(LayoutMismatch, match=message):
        check_compatible(decode, _layout(4))
    check_compatible(_layout(6), _layout(4))  # ring spans may differ


# --- engines ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache = {"bundled": resolve_model(None)[0]}

    def get(kind: str):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"pd-{kind}")
            # V4 with ratio-128 HCA and 128-token blocks (the real compression boundaries), window 16
            over = dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}) \
                if kind == "v4" else {}
            cache[kind] = save_reference(make_reference(kind, seed=7, **over), path)
        return cache[kind]
    return get


BLOCK = {"bundled": 0, "v4": 128, "v3": 64}


def _engines(path, kind: str, backend: str, n_prefill: int = 1, n_decode: int = 1, **extra):
    base = EngineArgs(**COMMON, block_size=BLOCK[kind], **extra)
    pd = dict(disaggregation_transfer_backend=backend)
    prefill = [EngineCore(path, replace(base, disaggregation_mode="prefill", **pd)) for _ in range(n_prefill)]
    decode = [EngineCore(path, replace(base, disaggregation_mode="decode", **pd)) for _ in range(n_decode)]
    return prefill, decode


def _prompts(kind: str, vocab: int, seed: int = 0) -> list[list[int]]:
    lengths = {"bundled": [5, 15, 16, 17, 31, 33, 100], "v4": [3, 127, 128, 129, 255, 257, 131],
               "v3": [5, 63, 64, 65, 130]}[kind]
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def colocated(path, kind: str, prompts, params=GREEDY, **extra) -> list[list[int]]:
    core = EngineCore(path, EngineArgs(**COMMON, block_size=BLOCK[kind], **extra))
    reqs = [core.add_request(f"c{i}", p, params)[0] for i, p in enumerate(prompts)]
    while core.has_unfinished:
        core.step()
    core.shutdown()
    return [r.output_token_ids for r in reqs]


def disaggregated(prefill, decode, prompts, params=GREEDY, timeout_s: float = 120):
    """Every prompt prefilled on prefill[i % P] and decoded on decode[i % D], all in flight together."""
    reqs = {}
    for i, p in enumerate(prompts):
        prefill[i % len(prefill)].add_request(f"r{i}", p, params, kv_transfer={"do_remote_decode": True})
    sent, deadline = set(), time.monotonic() + timeout_s
    while len(sent) < len(prompts) or any(c.has_unfinished for c in decode):
        assert time.monotonic() < deadline, "disaggregated run did not finish"
        for core in prefill:
            for req in core.step() if core.has_unfinished else core.service_transfers():
                if req.kv_transfer_params is not None:
                    i = int(req.request_id[1:])
                    sent.add(i)
                    d = decode[i % len(decode)]
                    reqs[i] = d.add_request(req.request_id, prompts[i], params, kv_transfer=req.kv_transfer_params)[0]
        for core in decode:
            if core.has_unfinished:
                core.step()
    _settle(prefill, decode)
    return [reqs[i] for i in range(len(prompts))]


def _settle(prefill, decode, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (any(c.connector.num_held for c in prefill)
                                           or any(c.scheduler.loading for c in decode)):
        for core in prefill + decode:
            core.service_transfers()
        time.sleep(0.01)


def assert_idle(*cores) -> None:
    """No leaked blocks, slots or holds: the cache counters are back where they started."""
    for core in cores:
        assert core.kv.num_free_blocks == core.layout.num_blocks
        assert core.kv.num_free_slots == core.layout.num_state_slots
        assert not core.kv.blocks and not core.scheduler.receiving and not core.scheduler.loading
        if core.connector.role == "prefill":
            assert core.connector.num_held == 0


def _close(*cores) -> None:
    for core in cores:
        core.shutdown()


def _cells(*cells):
    """(kind, backend, slow) -> params; Mooncake cells skip with the reason when the wheel cannot load."""
    out = []
    for kind, backend, slow in cells:
        marks = [pytest.mark.slow] if slow else []
        if MISSING[backend]:
            marks.append(pytest.mark.skip(reason=MISSING[backend]))
        out.append(pytest.param(kind, backend, marks=marks, id=f"{kind}-{backend}"))
    return out


@pytest.mark.parametrize("kind, backend", _cells(("bundled", "local", False), ("bundled", "mooncake", False),
                                                 ("bundled", "dlslime", False), ("v4", "local", False),
                                                 ("v3", "mooncake", False), ("v4", "mooncake", True),
                                                 ("v4", "dlslime", True), ("v3", "local", True),
                                                 ("v3", "dlslime", True)))
def test_greedy_tokens_equal_a_colocated_engine(ckpts, kind, backend):
    path = ckpts(kind)
    prefill, decode = _engines(path, kind, backend)
    prompts = _prompts(kind, prefill[0].model_config.vocab_size)
    got = disaggregated(prefill, decode, prompts)
    assert [r.output_token_ids for r in got] == colocated(path, kind, prompts)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in got)
    assert decode[0].connector.stats.received == len(prompts) and prefill[0].connector.stats.released == len(prompts)
    assert_idle(*prefill, *decode)
    _close(*prefill, *decode)


@pytest.mark.parametrize("kind, backend", _cells(("bundled", "local", False), ("bundled", "mooncake", True),
                                                 ("bundled", "dlslime", True)))
def test_two_prefill_and_two_decode_engines_with_kv_quantisation(ckpts, kind, backend):
    """2P2D, fp8 paged KV on every engine: the same tokens as a colocated fp8 engine."""
    path = ckpts(kind)
    prefill, decode = _engines(path, kind, backend, 2, 2, kv_cache_dtype="fp8")
    prompts = _prompts(kind, prefill[0].model_config.vocab_size, seed=3)
    got = disaggregated(prefill, decode, prompts)
    assert [r.output_token_ids for r in got] == colocated(path, kind, prompts, kv_cache_dtype="fp8")
    assert all(c.connector.stats.received == len(prompts) // 2 + (i == 0) * (len(prompts) % 2)
               for i, c in enumerate(decode))
    assert_idle(*prefill, *decode)
    _close(*prefill, *decode)


def test_a_prefix_hit_on_the_decode_side_shrinks_the_transfer(ckpts):
    path = ckpts("bundled")
    prefill, decode = _engines(path, "bundled", "local")
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(64)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(9)] for _ in range(3)]
    first = disaggregated(prefill, decode, prompts[:1])
    before = decode[0].connector.stats.bytes
    rest = disaggregated(prefill, decode, prompts[1:])
    per_request = [b for b, _ in decode[0].connector.stats.per_request]
    assert per_request[1] < before and per_request[1] == per_request[2]  # 4 cached blocks not read again
    assert decode[0].kv.prefix_hits >= 2 * 64
    assert [r.output_token_ids for r in first + rest] == colocated(path, "bundled", prompts)
    assert_idle(*prefill, *decode)
    _close(*prefill, *decode)


def test_mtp_speculation_on_the_decode_side(ckpts, tmp_path):
    """Both engines run MTP (the prefill engine computes the drafter's cache and first drafts, which travel);
    greedy tokens equal a colocated engine without speculation."""
    from test_spec_decode import _with_mtp

    path = _with_mtp(ckpts("v4"), tmp_path / "mtp")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prefill, decode = _engines(path, "v4", "local", speculative_config=spec)
    prompts = _prompts("v4", prefill[0].model_config.vocab_size, seed=4)[:5]
    got = disaggregated(prefill, decode, prompts)
    assert [r.output_token_ids for r in got] == colocated(path, "v4", prompts)
    assert any(name.startswith("mtp.") for name in decode[0].connector.layout["components"])
    assert decode[0].scheduler.spec_stats.num_draft_tokens > 0
    assert_idle(*prefill, *decode)
    _close(*prefill, *decode)


def test_the_ring_rows_are_what_makes_it_exact(ckpts, monkeypatch):
    """Control: a transfer that drops the sliding-window and compressor rings changes the tokens, so the
    equality above is not vacuous."""
    path = ckpts("bundled")
    prefill, decode = _engines(path, "bundled", "local")
    monkeypatch.setattr(plan_mod, "_ring", lambda *a: [])
    prompts = _prompts("bundled", prefill[0].model_config.vocab_size)[-2:]
    got = disaggregated(prefill, decode, prompts)
    assert [r.output_token_ids for r in got] != colocated(path, "bundled", prompts)
    _close(*prefill, *decode)


# --- faults -----------------------------------------------------------------------------------------
@pytest.fixture
def faults(monkeypatch):
    monkeypatch.setattr(LocalTransport, "faults", {"delay_s": 0.0, "fail": False})
    return LocalTransport.faults


def _prefilled(prefill, prompt, rid="x"):
    req = prefill.add_request(rid, prompt, GREEDY, kv_transfer={"do_remote_decode": True})[0]
    while prefill.has_unfinished:
        prefill.step()
    assert req.kv_transfer_params is not None and prefill.connector.num_held == 1
    return req


def _run(core, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while core.has_unfinished or core.scheduler.loading:
        assert time.monotonic() < deadline
        core.step() if core.has_unfinished else core.service_transfers()


def test_abort_during_the_transfer_frees_both_sides(ckpts, faults):
    path = ckpts("bundled")
    (prefill,), (decode,) = _engines(path, "bundled", "local")
    sent = _prefilled(prefill, list(range(3, 60)))
    faults["delay_s"] = 0.5
    decode.add_request("x", sent.prompt_token_ids, GREEDY, kv_transfer=sent.kv_transfer_params)
    decode.step()  # reserves and starts the read
    assert decode.scheduler.receiving and decode.kv.num_free_blocks < decode.layout.num_blocks
    decode.abort("x")
    assert decode.kv.blocks, "the blocks must stay while the read may still write them"
    _run(decode)
    _settle([prefill], [decode])
    assert_idle(prefill, decode)
    _close(prefill, decode)


def test_an_uncollected_transfer_is_freed_by_its_lease(ckpts):
    path = ckpts("bundled")
    (prefill,), (decode,) = _engines(path, "bundled", "local", disaggregation_lease_s=0.3)
    _prefilled(prefill, list(range(3, 40)))  # its decode engine never comes (died)
    time.sleep(0.35)
    prefill.service_transfers()
    assert prefill.connector.stats.leases_expired == 1
    assert_idle(prefill, decode)
    _close(prefill, decode)


def _failed_on_decode(decode, sent):
    req = decode.add_request("x", sent.prompt_token_ids, GREEDY, kv_transfer=sent.kv_transfer_params)[0]
    started = time.monotonic()
    _run(decode)
    assert req.status == RequestStatus.FINISHED_ERROR
    return req.stop_reason, time.monotonic() - started


def test_a_prefill_engine_that_dies_mid_transfer_frees_the_reservation(ckpts, faults):
    path = ckpts("bundled")
    (prefill,), (decode,) = _engines(path, "bundled", "local", disaggregation_transfer_timeout_s=1.0)
    sent = _prefilled(prefill, list(range(3, 60)))
    faults["delay_s"] = 5.0  # the read hangs, then the engine is gone
    reason, seconds = _failed_on_decode(decode, sent)
    # the engine's bound or the transport's own read timeout, whichever notices first
    assert "within 1.0 s" in reason and seconds < 3
    prefill.shutdown()
    assert_idle(decode)
    decode.shutdown()


def test_an_injected_transfer_failure_fails_only_that_request(ckpts, faults):
    path = ckpts("bundled")
    (prefill,), (decode,) = _engines(path, "bundled", "local")
    sent = _prefilled(prefill, list(range(3, 60)))
    faults["fail"] = True
    reason, _ = _failed_on_decode(decode, sent)
    assert "injected transfer failure" in reason
    faults["fail"] = False
    ok = disaggregated([prefill], [decode], [list(range(5, 30))])  # the engines keep serving
    assert ok[0].status == RequestStatus.FINISHED_LENGTH
    _settle([prefill], [decode])
    assert_idle(prefill, decode)
    _close(prefill, decode)


def test_a_mismatched_layout_is_refused_at_the_handshake(ckpts):
    path = ckpts("bundled")
    (prefill,), _ = _engines(path, "bundled", "local")
    _, (decode,) = _engines(path, "bundled", "local", kv_cache_dtype="fp8")
    sent = _prefilled(prefill, list(range(3, 60)))
    reason, _ = _failed_on_decode(decode, sent)
    assert "start both with the same --dtype and --kv-cache-dtype" in reason
    _settle([prefill], [decode])
    assert_idle(prefill, decode)
    _close(prefill, decode)


def test_a_different_prompt_is_refused(ckpts):
    path = ckpts("bundled")
    (prefill,), (decode,) = _engines(path, "bundled", "local")
    sent = _prefilled(prefill, list(range(3, 60)))
    req = decode.add_request("x", list(range(4, 61)), GREEDY, kv_transfer=sent.kv_transfer_params)[0]
    _run(decode)
    assert req.status == RequestStatus.FINISHED_ERROR and "different prompt" in req.stop_reason
    _settle([prefill], [decode])
    assert_idle(prefill, decode)
    _close(prefill, decode)


@pytest.mark.parametrize("mode, kv, message", [
    ("none", {"do_remote_decode": True}, "disaggregation mode is 'none'"),
    ("decode", {"do_remote_decode": True}, "for a prefill engine"),
    ("decode", {"remote_bootstrap": "127.0.0.1:1"}, "no transfer_id"),
])
def test_bad_transfer_params_are_rejected_up_front(ckpts, mode, kv, message):
    core = EngineCore(ckpts("bundled"), EngineArgs(**COMMON, disaggregation_mode=mode,
                                                   disaggregation_transfer_backend="local"))
    with pytest.raises(ValueError, match=message):
        core.add_request("x", [5, 6, 7], GREEDY, kv_transfer=kv)
    valid = {"prefill": {"do_remote_decode": True}, "decode": {"remote_bootstrap": "a:1", "transfer_id": "t"}}
    if mode in valid:
        with pytest.raises(ValueError, match="n=1"):
            core.add_request("y", [5, 6, 7], replace(GREEDY, n=2), kv_transfer=valid[mode])
    assert not core.scheduler.requests
    core.shutdown()


def test_a_preempted_decode_request_recomputes_its_cache_locally(ckpts):
    """A decode engine short of blocks preempts requests whose cache arrived; they recompute here (their hold
    on the prefill engine is gone) and still give a colocated engine's tokens."""
    path = ckpts("bundled")
    prefill, _ = _engines(path, "bundled", "local")
    small = dict(kv_cache_memory_bytes=8 * 65536 + 16 * 3328, max_num_seqs=8)
    decode = [EngineCore(path, EngineArgs(**{**COMMON, **small}, disaggregation_mode="decode",
                                          disaggregation_transfer_backend="local"))]
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(4)]
    params = replace(GREEDY, max_tokens=60)
    got = disaggregated(prefill, decode, prompts, params)
    assert decode[0].scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in got] == colocated(path, "bundled", prompts, params)
    assert_idle(*prefill, *decode)
    _close(*prefill, *decode)


def test_params_without_a_role_are_a_colocated_request(ckpts):
    """vLLM clients may send {"do_remote_decode": false}: served colocated, on any engine."""
    core = EngineCore(ckpts("bundled"), EngineArgs(**COMMON))
    req = core.add_request("x", [5, 6, 7], GREEDY, kv_transfer={"do_remote_decode": False})[0]
    while core.has_unfinished:
        core.step()
    assert req.status == RequestStatus.FINISHED_LENGTH and req.kv_transfer is None
    core.shutdown()
