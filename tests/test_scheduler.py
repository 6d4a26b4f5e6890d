"""Scheduler tests against a fake runner (no model).

The fake runner keeps a token-level model of the cache: every block holds the token ids written into it
and every state slot a digest of the tokens folded into it. Each step it checks that what a request
already computed is really in the blocks and slot it was handed, that it only writes to blocks nobody
else holds, applies fork copies, and samples random non-EOS tokens (EOS only where a test asks for it).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from deepinfer.config import SchedulerConfig
from deepinfer.engine.kv_cache import KVCacheManager
from deepinfer.engine.outputs import RunnerOutput, SchedulerOutput
from deepinfer.engine.scheduler import Scheduler, admission_key, stop_status
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams

EOS = 1
VOCAB = 1000
WAITING, RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING
STOPPED, LENGTH, ABORTED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                            RequestStatus.FINISHED_ABORTED)

_clock = itertools.count()


def make_group(rid: str, prompt_len: int, max_tokens: int, *, n: int = 1, priority: int = 0,
               rng: random.Random | None = None, prefix: list[int] | None = None, **params) -> list[Request]:
    """The n sample requests of one user request, built the way EngineCore.add_request builds them."""
    rng = rng or random.Random(prompt_len)
    prompt = ((prefix or []) + [rng.randrange(2, VOCAB) for _ in range(prompt_len)])[:prompt_len]
    sp = SamplingParams(n=n, max_tokens=max_tokens, **params)
    arrival = float(next(_clock))
    group: list[Request] = []
    for i in range(n):
        group.append(Request(rid if n == 1 else f"{rid}-{i}", list(prompt), sp, max_tokens, priority=priority,
                             eos_token_ids=(EOS,), arrival_time=arrival, sample_index=i,
                             fork_of=group[0] if i else None))
    return group


def make_scheduler(*, num_blocks: int = 64, block_size: int = 16, num_state_slots: int | None = None,
                   max_model_len: int = 4096, prefix_caching: bool = False, replay_tokens: int = 0,
                   num_snapshots: int = 0, **config) -> Scheduler:
    cfg = SchedulerConfig(**config)
    slots = cfg.max_num_seqs if num_state_slots is None else num_state_slots
    kv = KVCacheManager(num_blocks, block_size, slots, enable_prefix_caching=prefix_caching,
                        num_snapshot_slots=num_snapshots)
    return Scheduler(cfg, kv, max_model_len, replay_tokens=replay_tokens)


def add(sched: Scheduler, group: list[Request]) -> list[Request]:
    for r in group:
        sched.add(r)
    return group


class FakeRunner:
    """Stands in for ModelRunner.execute: checks and updates a token-level model of the cache."""

    def __init__(self, kv: KVCacheManager, seed: int = 0):
        self.kv = kv
        self.rng = random.Random(seed)
        self.block_tokens: dict[int, list[int]] = {}
        self.slot_state: dict[int, tuple[int, int]] = {}  # slot -> (tokens folded in, digest of them)
        self.sampled: dict[str, list[int]] = {}  # every token handed out, per request
        self.forced: dict[tuple[str, int], int] = {}  # (request id, output index) -> token to sample

    def __call__(self, out: SchedulerOutput) -> RunnerOutput:
        bs, refs = self.kv.block_size, self.kv.pool._refs
        # blocks a request shares with the children forked from it this step (they read them after it)
        new_shares = Counter((f.parent_id, b) for f in out.forks for b in self.kv.blocks[f.child_id])
        restored = {slot for _, slot in out.restores}
        for row, slot in out.restores:  # before the step, like ModelRunner._copy_state
            self.slot_state[slot] = self.slot_state[row]
        result = RunnerOutput()
        for s in out.scheduled:
            req = s.request
            start, end = s.start, s.start + s.num_new_tokens
            # every token handed out so far: with async scheduling the scheduler has not seen the last yet
            tokens = req.prompt_token_ids + self.sampled.get(req.request_id, [])
            assert 0 < s.num_new_tokens and end <= len(tokens)
            # a prefix hit's bounded state is replayed, unless a snapshot was restored (then it must be exact)
            rebuilding = 0 < req.resume_point and start <= req.resume_point and s.state_slot not in restored
            if start and not rebuilding:  # everything computed so far must be in the cache we are handed
                assert self.slot_state.get(s.state_slot) == (start, hash(tuple(tokens[:start]))), req
                for j in range(-(-start // bs)):
                    lo, hi = j * bs, min(j * bs + bs, start)
                    assert self.block_tokens.get(s.block_ids[j], [])[: hi - lo] == tokens[lo:hi], (req, j)
            if rebuilding:  # the shared prefix must hold exactly this request's tokens
                for j in range(req.resume_point // bs):
                    assert self.block_tokens.get(s.block_ids[j]) == tokens[j * bs:(j + 1) * bs], (req, j)
            for j in range(s.write_from // bs, -(-end // bs)):
                block = s.block_ids[j]
                holders = refs[block] - new_shares[req.request_id, block]
                assert holders == 1, f"{req.request_id} writes to shared block {block}"
                lo, hi = max(s.write_from, j * bs), min(end, j * bs + bs)
                data = self.block_tokens.setdefault(block, [-1] * bs)
                data[lo - j * bs: hi - j * bs] = tokens[lo:hi]
            self.slot_state[s.state_slot] = (end, hash(tuple(tokens[:end])))
            if s.samples:
                result.sampled[req.request_id] = self._sample(req)
        for slot, row in out.snapshots:  # after the step
            self.slot_state[row] = self.slot_state[slot]
        for fork, child in zip(out.forks, out.fork_children):  # after the step, like _apply_forks
            assert fork.child_id == child.request_id and fork.parent_id in result.sampled
            if fork.src_block is not None:
                self.block_tokens[fork.dst_block] = list(self.block_tokens[fork.src_block])
            self.slot_state[fork.dst_slot] = self.slot_state[fork.src_slot]
            result.sampled[child.request_id] = self._sample(child)
        return result

    def _sample(self, req: Request) -> int:
        handed_out = len(self.sampled.get(req.request_id, []))
        token = self.forced.get((req.request_id, handed_out), self.rng.randrange(2, VOCAB))
        self.sampled.setdefault(req.request_id, []).append(token)
        return token


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, runner(out))
    return out


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return outs
        outs.append(step(sched, runner))
        assert not outs[-1].is_empty, "no progress with unfinished requests"
    raise AssertionError(f"not finished after {max_steps} steps")


def where(sched: Scheduler, req: Request) -> str:
    if req in sched.running:
        return "running"
    if any(req in siblings for siblings in sched.pending_forks.values()):
        return "pending"
    if req in sched.waiting:
        return "waiting"
    return "gone"


def assert_holdings(sched: Scheduler) -> None:
    """Running requests hold blocks and one unique slot each; nobody else holds anything; ref counts
    equal the number of holders; every live request is in exactly one of running / waiting / pending."""
    kv = sched.kv
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    pending = [r.request_id for siblings in sched.pending_forks.values() for r in siblings]
    everyone = running + waiting + pending
    assert len(everyone) == len(set(everyone)) and set(everyone) == set(sched.requests)
    assert len(running) <= sched.config.max_num_seqs
    assert set(kv.blocks) == set(running) and set(kv.slots) == set(running)
    slots = list(kv.slots.values())
    assert sorted(slots + kv._free_slots) == list(range(kv.num_state_slots)), "slot shared or lost"
    held = Counter(b for ids in kv.blocks.values() for b in ids)
    assert kv.pool._refs == [held.get(b, 0) for b in range(kv.pool.num_blocks)]
    unheld = sorted(kv.pool._free + list(kv.pool._evictable))  # evictable: cached prefix blocks nobody holds
    assert unheld == [b for b in range(kv.pool.num_blocks) if not held.get(b)]
    for r in sched.running:
        assert r.status is RUNNING and r.num_computed_tokens <= r.num_tokens + r.num_pending
        assert len(kv.blocks[r.request_id]) * kv.block_size >= r.num_computed_tokens
    for r in itertools.chain(sched.waiting, *sched.pending_forks.values()):
        assert r.status is WAITING and r.num_computed_tokens == 0


def assert_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg, kv = sched.config, sched.kv
    assert out.num_tokens <= cfg.max_num_batched_tokens
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    for s in out.scheduled:
        req = s.request
        assert req in sched.running
        assert s.block_ids == kv.blocks[req.request_id]
        # a prefix hit holds its cached blocks from admission on, also while replaying positions below them
        hit_blocks = s.request.resume_point // kv.block_size
        assert len(s.block_ids) == max(kv.blocks_needed(s.start + s.num_new_tokens), hit_blocks)
        assert s.state_slot == kv.slots[req.request_id]
        assert 0 < s.num_new_tokens <= req.num_tokens + req.num_pending - s.start
        if not cfg.enable_chunked_prefill:
            assert s.samples, "a partial prompt was scheduled without chunked prefill"
    for fork, child in zip(out.forks, out.fork_children):
        parent = sched.requests[fork.parent_id]
        assert child.fork_of is parent and not parent.output_token_ids
        assert child.num_computed_tokens == parent.num_prompt_tokens
        full = parent.num_prompt_tokens // kv.block_size
        assert kv.blocks[child.request_id][:full] == kv.blocks[parent.request_id][:full]
        assert (fork.src_slot, fork.dst_slot) == (kv.slots[parent.request_id], kv.slots[child.request_id])
    assert_holdings(sched)


# --- 1. invariant fuzz ---------------------------------------------------------------------------
def fuzz(policy: str, *, num_requests: int, chunked: bool = True, budget: int = 64, max_prompt: int = 300,
         num_blocks: int = 48, num_state_slots: int = 16, abort_rate: float = 0.03,
         arrival_rate: float = 0.15, max_model_len: int = 4096, seed: int = 0, prefix_caching: bool = False,
         replay_tokens: int = 0, num_snapshots: int = 0, async_scheduling: bool = False) -> Counter:
    """With async_scheduling, each step's update is applied only after the next step was scheduled and
    run (the worker may run step N+1 before the engine folds in step N), and aborts land in between."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, block_size=16, num_state_slots=num_state_slots,
                           max_model_len=max_model_len, max_num_seqs=16, prefix_caching=prefix_caching,
                           replay_tokens=replay_tokens, num_snapshots=num_snapshots,
                           max_num_batched_tokens=budget, enable_chunked_prefill=chunked, policy=policy,
                           async_scheduling=async_scheduling)
    in_flight = None
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(64)] for _ in range(3)] if prefix_caching else [None]
    runner = FakeRunner(sched.kv, seed)
    everything: list[Request] = []
    aborted: set[str] = set()
    forked: set[str] = set()
    stats: Counter = Counter()
    for step_no in range(200_000):
        for _ in range(rng.randint(1, 3) if rng.random() < arrival_rate else 0):
            if stats["added"] < num_requests:
                n = rng.choice((2, 3)) if rng.random() < 0.15 else 1
                group = make_group(f"r{stats['added']}", rng.randint(1, max_prompt), rng.randint(1, 40), n=n,
                                   priority=rng.randint(0, 3) if policy == "priority" else 0, rng=rng,
                                   prefix=rng.choice(prefixes))
                everything += add(sched, group)
                stats["added"] += 1
        for rid in list(sched.requests):
            if rid in sched.requests and rng.random() < abort_rate:
                req = sched.requests[rid]
                stats[f"abort_{where(sched, req)}"] += 1
                siblings = list(sched.pending_forks.get(rid, []))
                assert sched.finish(rid, ABORTED) is req and req.status is ABORTED
                assert all(c in sched.waiting and c.fork_of is None for c in siblings)
                aborted.add(rid)
        assert_holdings(sched)
        if not sched.has_unfinished and stats["added"] == num_requests and in_flight is None:
            break
        running_before = list(sched.running)
        if policy == "priority":
            running_before.sort(key=lambda r: admission_key(r, "priority"))
        out = sched.schedule()
        assert_step(sched, out)
        # victims are always taken from the back: latest admitted (fcfs) / lowest priority (priority)
        victims = [r for r in running_before if r.request_id in out.preempted]
        assert len(victims) == len(out.preempted)
        assert victims == running_before[len(running_before) - len(victims):]
        stats["preemptions"] += len(out.preempted)
        stats["readmitted"] += len(set(out.preempted) & {s.request.request_id for s in out.scheduled})
        forked |= {c.request_id for c in out.fork_children}
        if sched.has_unfinished and in_flight is None:
            assert not out.is_empty, f"step {step_no}: nothing scheduled"
        result = runner(out)
        if async_scheduling:
            if in_flight is not None:
                sched.update(*in_flight)
            in_flight = (out, result) if not out.is_empty else None
        else:
            sched.update(out, result)
        assert_holdings(sched)
    else:
        raise AssertionError("fuzz did not finish")

    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and kv.num_free_slots == kv.num_state_slots
    assert not kv.blocks and not kv.slots and kv.pool._refs == [0] * kv.pool.num_blocks
    assert not sched.waiting and not sched.running and not sched.pending_forks and not sched.requests
    for req in everything:
        handed_out = runner.sampled.get(req.request_id, [])
        if async_scheduling and req.request_id in aborted:  # a token in flight at the abort is dropped
            assert req.output_token_ids == handed_out[:len(req.output_token_ids)]
            stats["dropped_in_flight"] += len(handed_out) - len(req.output_token_ids)
        else:
            assert req.output_token_ids == handed_out
        if req.request_id in aborted:
            assert req.status is ABORTED and len(req.output_token_ids) <= req.max_output_tokens
        else:
            assert req.status is LENGTH, req
            assert len(req.output_token_ids) == req.max_output_tokens, req
            stats["completed"] += 1
            if req.sample_index:
                stats["forked_children" if req.request_id in forked else "fallback_children"] += 1
    stats["steps"] = step_no
    stats["prefix_hits"] = kv.prefix_hits
    stats["snapshot_restores"] = sched.num_snapshot_restores
    return stats


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_fuzz_invariants(policy):
    """1,000 requests (some n>1) trickle in over time, ~3% of live requests are aborted per step and the
    cache (48 blocks of 16) holds about two and a half 300-token prompts, so preemption and fork fallback
    happen all the time."""
    stats = fuzz(policy, num_requests=1000, seed=1 if policy == "fcfs" else 2)
    assert stats["preemptions"] > 0
    assert stats["abort_waiting"] > 0 and stats["abort_running"] > 0 and stats["abort_pending"] > 0
    assert stats["forked_children"] > 0 and stats["fallback_children"] > 0
    assert stats["completed"] > 200


@pytest.mark.parametrize("replay_tokens", [0, 24])
def test_fuzz_invariants_with_prefix_caching(replay_tokens):
    """Prompts often share one of three 4-block prefixes; hits must hold exactly the hashed tokens, nobody
    writes a shared block, and every block is free (cached or not) at the end."""
    stats = fuzz("fcfs", num_requests=500, seed=5, prefix_caching=True, replay_tokens=replay_tokens, num_blocks=64)
    assert stats["preemptions"] > 0 and stats["completed"] > 100 and stats["prefix_hits"] > 64 * 100


def test_fuzz_invariants_with_prefix_snapshots():
    """Snapshots of bounded state at block boundaries: every restored snapshot must hold exactly the state
    of the hashed prefix (the fake runner checks slot contents after a restore)."""
    stats = fuzz("fcfs", num_requests=500, seed=6, prefix_caching=True, replay_tokens=24, num_snapshots=8,
                 num_blocks=64)
    assert stats["snapshot_restores"] > 10 and stats["completed"] > 100


def test_fuzz_invariants_with_prefix_snapshots_without_chunked_prefill():
    stats = fuzz("fcfs", num_requests=300, chunked=False, budget=128, max_prompt=80, num_blocks=24,
                 num_state_slots=24, max_model_len=128, seed=7, prefix_caching=True, replay_tokens=24,
                 num_snapshots=8)
    assert stats["completed"] > 50 and stats["prefix_hits"] > 0


@pytest.mark.parametrize("prefix_caching, snapshots", [(False, 0), (True, 0), (True, 8)])
def test_fuzz_invariants_with_async_scheduling(prefix_caching, snapshots):
    """Updates lag one step behind scheduling, as with the async engine: placeholders, aborts while a
    token is in flight, preemption of a request with a pending token, forks, prefix hits, snapshots."""
    stats = fuzz("fcfs", num_requests=500, seed=8, async_scheduling=True, prefix_caching=prefix_caching,
                 num_blocks=64 if prefix_caching else 48, replay_tokens=24 if prefix_caching else 0,
                 num_snapshots=snapshots)
    assert stats["preemptions"] > 0 and stats["completed"] > 100 and stats["dropped_in_flight"] > 0
    assert stats["abort_running"] > 0 and stats["forked_children"] > 0
    assert stats["snapshot_restores"] > 0 if snapshots else stats["snapshot_restores"] == 0


def test_fuzz_invariants_with_fewer_state_slots_than_seqs():
    stats = fuzz("priority", num_requests=300, num_state_slots=5, num_blocks=64, seed=4)
    assert stats["preemptions"] > 0 and stats["completed"] > 50


def test_fuzz_invariants_without_chunked_prefill():
    # prompt + output never exceeds the budget, so a preempted request can always be resumed whole;
    # more state slots than max_num_seqs, so only max_num_seqs bounds the running set
    stats = fuzz("fcfs", num_requests=300, chunked=False, budget=128, max_prompt=80, num_blocks=24,
                 num_state_slots=24, max_model_len=128, seed=3)
    assert stats["preemptions"] > 0 and stats["completed"] > 50


# --- 2. budget and chunking ------------------------------------------------------------------------
def test_long_prompt_is_chunked_to_the_budget():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    (req,) = add(sched, make_group("a", 150, 3))
    outs = run_to_completion(sched, runner)
    assert [(o.scheduled[0].start, o.num_tokens) for o in outs] == [
        (0, 64), (64, 64), (128, 22), (150, 1), (151, 1)]
    assert [len(o.scheduled) for o in outs] == [1] * 5
    assert req.status is LENGTH and len(req.output_token_ids) == 3
    assert req.output_token_ids == runner.sampled["a"]


def test_chunks_grow_blocks_step_by_step():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    add(sched, make_group("a", 150, 3))
    held = []
    for _ in range(3):
        out = step(sched, runner)
        held.append(len(out.scheduled[0].block_ids))
        assert out.scheduled[0].samples == (held == [4, 8, 10])
    assert held == [4, 8, 10]


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(sched.kv)
    add(sched, make_group("a", 4, 10))
    add(sched, make_group("b", 4, 10))
    out = step(sched, runner)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 4), ("b", 4)]
    add(sched, make_group("c", 20, 10))
    out = step(sched, runner)
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 4, 1), ("b", 4, 1), ("c", 0, 6)]
    add(sched, make_group("d", 2, 10))
    out = step(sched, runner)
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 5, 1), ("b", 5, 1), ("c", 6, 6)]
    assert [r.request_id for r in sched.waiting] == ["d"], "no budget left for a new prefill"


def test_running_prefill_chunk_shares_the_budget_with_new_prompts():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    add(sched, make_group("a", 100, 2))
    step(sched, runner)
    add(sched, make_group("b", 50, 2))
    out = step(sched, runner)
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 64, 36), ("b", 0, 28)]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2, num_state_slots=8)
    runner = FakeRunner(sched.kv)
    for rid in "abc":
        add(sched, make_group(rid, 4, 2))
    out = step(sched, runner)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    run_to_completion(sched, runner)


def test_without_chunked_prefill_prompts_are_never_split():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=16)
    runner = FakeRunner(sched.kv)
    add(sched, make_group("a1", 4, 3))
    add(sched, make_group("a2", 4, 3))
    step(sched, runner)
    (b,) = add(sched, make_group("b", 15, 1))
    out = step(sched, runner)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a1", 1), ("a2", 1)]
    assert b.status is WAITING and b.num_computed_tokens == 0 and "b" not in sched.kv.blocks
    outs = run_to_completion(sched, runner)
    first_b = next(s for o in outs for s in o.scheduled if s.request is b)
    assert (first_b.start, first_b.num_new_tokens) == (0, 15)
    assert all(s.samples for o in outs for s in o.scheduled)
    assert b.status is LENGTH and len(b.output_token_ids) == 1


# --- 3. preemption ---------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, victim_id, survivor_id", [("fcfs", "hi", "lo"), ("priority", "lo", "hi")])
def test_preemption_picks_the_last_admitted_or_lowest_priority(policy, victim_id, survivor_id):
    # 4 blocks of 4 tokens. lo (priority 5) is admitted first, hi (priority 0) second; together they fill
    # the cache, and the next decode step needs a third block for whoever is scheduled first.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                           policy=policy)
    runner = FakeRunner(sched.kv)
    (lo,) = add(sched, make_group("lo", 7, 4, priority=5))
    step(sched, runner)
    (hi,) = add(sched, make_group("hi", 8, 4, priority=0))
    step(sched, runner)
    assert sched.kv.num_free_blocks == 0 and [len(r.output_token_ids) for r in (lo, hi)] == [2, 1]
    (late,) = add(sched, make_group("late", 2, 1, priority=9))
    victim, survivor = sched.requests[victim_id], sched.requests[survivor_id]
    outputs = list(victim.output_token_ids)

    out = step(sched, runner)
    assert out.preempted == [victim_id]
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [(survivor_id, 1)]
    assert victim.status is WAITING and victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    assert victim.output_token_ids == outputs, "preemption keeps the generated tokens"
    assert list(sched.waiting) == [victim, late], "the victim goes to the front of the queue"
    assert victim_id not in sched.kv.blocks and victim_id not in sched.kv.slots
    assert sched.running == [survivor]
    assert_holdings(sched)

    outs = run_to_completion(sched, runner)
    resumed = next(s for o in outs for s in o.scheduled if s.request is victim)
    assert (resumed.start, resumed.num_new_tokens) == (0, victim.num_prompt_tokens + len(outputs)), \
        "the resumed request recomputes its prompt and its outputs in one go"
    for req in (lo, hi, late):
        assert req.status is LENGTH and len(req.output_token_ids) == req.max_output_tokens
        assert req.output_token_ids == runner.sampled[req.request_id]
    assert victim.output_token_ids[: len(outputs)] == outputs
    assert sched.kv.num_free_blocks == 4 and sched.kv.num_free_slots == 4


def test_the_last_running_request_preempts_itself():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    (a,) = add(sched, make_group("a", 3, 2))
    (b,) = add(sched, make_group("b", 8, 2))
    step(sched, runner)  # a: 1 block, b: 2 blocks; b now needs a third one
    out = step(sched, runner)
    assert out.preempted == ["b"] and [s.request.request_id for s in out.scheduled] == ["a"]
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0 and len(b.output_token_ids) == 1
    run_to_completion(sched, runner)
    assert a.status is b.status is LENGTH and len(b.output_token_ids) == 2
    assert sched.kv.num_free_blocks == 3


def test_preempted_request_resumes_mid_decode_with_the_right_token_count():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    reqs = [add(sched, make_group(f"r{i}", 5, 12))[0] for i in range(3)]
    outs = run_to_completion(sched, runner)
    assert sum(len(o.preempted) for o in outs) > 0
    assert any(r.num_preemptions for r in reqs)
    for r in reqs:
        assert r.status is LENGTH and r.output_token_ids == runner.sampled[r.request_id]
        assert len(r.output_token_ids) == 12
    assert sched.kv.num_free_blocks == 6 and not sched.kv.blocks


def test_priority_preemption_keeps_higher_priority_waiting_requests_ahead():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, policy="priority")
    runner = FakeRunner(sched.kv)
    (lo,) = add(sched, make_group("lo", 7, 10, priority=5))
    step(sched, runner)
    add(sched, make_group("hi", 8, 4, priority=0))
    step(sched, runner)
    (w,) = add(sched, make_group("w", 3, 1, priority=1))  # fits in the block left after the preemption
    outs = run_to_completion(sched, runner)
    assert outs[0].preempted == ["lo"]
    first = {r: next(i for i, o in enumerate(outs) if any(s.request is r for s in o.scheduled))
             for r in (lo, w)}
    assert first[w] < first[lo], "w (priority 1) waited behind the preempted lo (priority 5)"


def test_a_request_preempted_in_a_step_is_not_readmitted_in_it():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=3)
    runner = FakeRunner(sched.kv)
    add(sched, make_group("a", 3, 10))
    step(sched, runner)
    (b,) = add(sched, make_group("b", 12, 2))
    outs = run_to_completion(sched, runner)
    assert b.num_preemptions > 0
    for o in outs:
        assert not set(o.preempted) & {s.request.request_id for s in o.scheduled}


# --- 4. abort --------------------------------------------------------------------------------------
def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and kv.num_free_slots == kv.num_state_slots
    assert not kv.blocks and not kv.slots and kv.pool._refs == [0] * kv.pool.num_blocks


def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched.kv)
    (a,) = add(sched, make_group("a", 10, 3))
    (b,) = add(sched, make_group("b", 10, 3))
    step(sched, runner)
    assert list(sched.waiting) == [b]
    free = sched.kv.num_free_blocks
    assert sched.finish("b", ABORTED) is b
    assert b.status is ABORTED and not sched.waiting and "b" not in sched.requests
    assert sched.kv.num_free_blocks == free
    assert sched.finish("b", ABORTED) is None, "a second abort is a no-op"
    run_to_completion(sched, runner)
    assert a.status is LENGTH and not b.output_token_ids
    assert_all_free(sched)


def test_abort_running_request_mid_prefill():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    (a,) = add(sched, make_group("a", 100, 3))
    step(sched, runner)
    assert a.status is RUNNING and len(sched.kv.blocks["a"]) == 4
    assert sched.finish("a", ABORTED) is a
    assert a.status is ABORTED and not sched.running and not sched.has_unfinished
    assert_all_free(sched)


def test_abort_running_request_mid_decode_lets_others_finish():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    (a,) = add(sched, make_group("a", 20, 10))
    (b,) = add(sched, make_group("b", 20, 10))
    for _ in range(3):
        step(sched, runner)
    sched.finish("a", ABORTED)
    assert sched.running == [b] and set(sched.kv.blocks) == {"b"}
    run_to_completion(sched, runner)
    assert a.status is ABORTED and len(a.output_token_ids) == 3
    assert b.status is LENGTH and len(b.output_token_ids) == 10
    assert_all_free(sched)


def test_abort_pending_fork_child():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    p, c1, c2 = add(sched, make_group("x", 100, 3, n=3))
    step(sched, runner)  # first prompt chunk; the children wait for the last one
    assert sched.pending_forks == {"x-0": [c1, c2]}
    assert sched.finish("x-2", ABORTED) is c2
    assert sched.pending_forks == {"x-0": [c1]} and c2.status is ABORTED
    out = step(sched, runner)
    assert out.fork_children == [c1] and not sched.pending_forks
    run_to_completion(sched, runner)
    assert p.status is c1.status is LENGTH and not c2.output_token_ids
    assert_all_free(sched)


def test_abort_all_pending_children_then_parent_finishes():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    p, c1, c2 = add(sched, make_group("x", 100, 3, n=3))
    step(sched, runner)
    sched.finish("x-1", ABORTED)
    sched.finish("x-2", ABORTED)
    outs = run_to_completion(sched, runner)
    assert not any(o.forks for o in outs)
    assert p.status is LENGTH and not sched.pending_forks and not sched.has_unfinished
    assert_all_free(sched)


def test_abort_forked_child_keeps_parent_blocks():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    p, c = add(sched, make_group("x", 40, 5, n=2))
    step(sched, runner)
    shared = sched.kv.blocks["x-0"][:2]
    assert [sched.kv.pool._refs[b] for b in shared] == [2, 2]
    sched.finish("x-1", ABORTED)
    assert [sched.kv.pool._refs[b] for b in shared] == [1, 1]
    assert sched.running == [p] and set(sched.kv.slots) == {"x-0"}
    run_to_completion(sched, runner)
    assert p.status is LENGTH and len(p.output_token_ids) == 5 and len(c.output_token_ids) == 1
    assert_all_free(sched)


def test_abort_parent_releases_pending_siblings():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    p, c1, c2 = add(sched, make_group("x", 100, 3, n=3))
    step(sched, runner)
    assert p.status is RUNNING and p.num_computed_tokens == 64
    assert sched.finish("x-0", ABORTED) is p
    assert not sched.pending_forks and list(sched.waiting) == [c1, c2]
    assert c1.fork_of is None and c2.fork_of is None and c1.status is c2.status is WAITING
    assert not sched.kv.blocks
    outs = run_to_completion(sched, runner)
    assert not any(o.forks for o in outs), "the siblings prefill on their own"
    assert outs[0].scheduled[0].request is c1 and outs[0].scheduled[0].start == 0
    for c in (c1, c2):
        assert c.status is LENGTH and len(c.output_token_ids) == 3
        assert c.output_token_ids == runner.sampled[c.request_id]
    assert_all_free(sched)


def test_abort_waiting_parent_releases_pending_siblings():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched.kv)
    add(sched, make_group("a", 10, 2))
    p, c = add(sched, make_group("x", 10, 2, n=2))
    step(sched, runner)
    assert list(sched.waiting) == [p] and sched.pending_forks == {"x-0": [c]}
    sched.finish("x-0", ABORTED)
    assert list(sched.waiting) == [c] and c.fork_of is None and not sched.pending_forks
    run_to_completion(sched, runner)
    assert c.status is LENGTH and len(c.output_token_ids) == 2
    assert_all_free(sched)


# --- 5. n > 1 forks --------------------------------------------------------------------------------
def test_children_fork_after_the_last_prompt_chunk():
    sched = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(sched.kv)
    p, c1, c2 = add(sched, make_group("x", 40, 4, n=3))
    out = step(sched, runner)
    assert not out.forks and sched.pending_forks == {"x-0": [c1, c2]} and not c1.output_token_ids

    out = sched.schedule()
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [("x-0", 32, 8)]
    assert out.fork_children == [c1, c2] and not sched.pending_forks
    kv = sched.kv
    parent_blocks = kv.blocks["x-0"]
    for c, fork in zip((c1, c2), out.forks):
        assert c.status is RUNNING and c.num_computed_tokens == 40 and c in sched.running
        assert kv.blocks[c.request_id][:2] == parent_blocks[:2], "full prompt blocks are shared"
        assert kv.blocks[c.request_id][2] not in parent_blocks, "the partial block is the child's own"
        assert (fork.parent_id, fork.child_id) == ("x-0", c.request_id)
        assert (fork.src_block, fork.dst_block) == (parent_blocks[2], kv.blocks[c.request_id][2])
        assert (fork.src_slot, fork.dst_slot) == (kv.slots["x-0"], kv.slots[c.request_id])
    assert [kv.pool._refs[b] for b in parent_blocks] == [3, 3, 1]
    assert_step(sched, out)
    sched.update(out, runner(out))
    assert [len(r.output_token_ids) for r in (p, c1, c2)] == [1, 1, 1]

    out = step(sched, runner)
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("x-0", 40, 1), ("x-1", 40, 1), ("x-2", 40, 1)]
    outs = run_to_completion(sched, runner)
    assert all(s.num_new_tokens == 1 for o in outs for s in o.scheduled), "no sample ever prefills again"
    for r in (p, c1, c2):
        assert r.status is LENGTH and len(r.output_token_ids) == 4
        assert r.output_token_ids == runner.sampled[r.request_id]
    assert_all_free(sched)


def test_fork_of_a_block_aligned_prompt_shares_every_block():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    p, c = add(sched, make_group("x", 32, 3, n=2))
    out = sched.schedule()
    (fork,) = out.forks
    assert fork.src_block is None and fork.dst_block is None
    assert sched.kv.blocks["x-1"] == sched.kv.blocks["x-0"]
    sched.update(out, runner(out))
    out = step(sched, runner)  # both cross into a new block of their own
    assert sched.kv.blocks["x-1"][:2] == sched.kv.blocks["x-0"][:2]
    assert sched.kv.blocks["x-1"][2] != sched.kv.blocks["x-0"][2]
    run_to_completion(sched, runner)
    assert p.status is c.status is LENGTH
    assert_all_free(sched)


def test_single_token_prompt_forks():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    group = add(sched, make_group("x", 1, 2, n=3))
    out = step(sched, runner)
    assert len(out.forks) == 2 and all(f.src_block is not None for f in out.forks)
    run_to_completion(sched, runner)
    assert all(r.status is LENGTH and len(r.output_token_ids) == 2 for r in group)
    assert_all_free(sched)


@pytest.mark.parametrize("short_of", ["slots", "blocks", "seqs"])
def test_sibling_without_room_to_fork_prefills_on_its_own(short_of):
    limits = {"slots": dict(num_state_slots=2), "blocks": dict(num_blocks=4),
              "seqs": dict(max_num_seqs=2, num_state_slots=8)}
    sched = make_scheduler(max_num_batched_tokens=64, **limits[short_of])
    runner = FakeRunner(sched.kv)
    p, c1, c2 = add(sched, make_group("x", 40, 4, n=3))
    out = step(sched, runner)
    assert out.fork_children == [c1]
    assert list(sched.waiting) == [c2] and c2.fork_of is None and not sched.pending_forks
    assert c2.status is WAITING and "x-2" not in sched.kv.blocks
    outs = run_to_completion(sched, runner)
    own = [s for o in outs for s in o.scheduled if s.request is c2]
    assert (own[0].start, own[0].num_new_tokens) == (0, 40), "the sibling prefills its prompt itself"
    assert not any(o.forks for o in outs)
    for r in (p, c1, c2):
        assert r.status is LENGTH and len(r.output_token_ids) == 4
    assert_all_free(sched)


def test_parent_preempted_mid_prompt_still_forks_later():
    # 4 blocks of 4 tokens: a decodes ahead of x's chunked prompt and keeps taking the blocks x needs
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=5)
    runner = FakeRunner(sched.kv)
    (a,) = add(sched, make_group("a", 4, 10))
    step(sched, runner)
    p, c = add(sched, make_group("x", 10, 2, n=2))
    outs = run_to_completion(sched, runner)
    preempted_at = [i for i, o in enumerate(outs) if "x-0" in o.preempted]
    forked_at = [i for i, o in enumerate(outs) if o.forks]
    assert len(forked_at) == 1 and outs[forked_at[0]].fork_children == [c]
    assert preempted_at and preempted_at[0] < forked_at[0], "x was preempted during its prompt"
    for r in (a, p, c):
        assert r.status is LENGTH and len(r.output_token_ids) == r.max_output_tokens
    assert_all_free(sched)


# --- 6. stop rules ---------------------------------------------------------------------------------
def emit(req: Request, token: int, max_model_len: int = 4096) -> RequestStatus | None:
    req.output_token_ids.append(token)
    return stop_status(req, token, max_model_len)


def one(max_tokens: int = 10, prompt_len: int = 4, **params) -> Request:
    return make_group("s", prompt_len, max_tokens, **params)[0]


def test_stop_on_eos():
    req = one()
    assert emit(req, 5) is None
    req.stop_reason = "stale"
    assert emit(req, EOS) is STOPPED and req.stop_reason is None


def test_eos_is_ignored_with_ignore_eos():
    req = one(max_tokens=3, ignore_eos=True)
    assert emit(req, EOS) is None and emit(req, EOS) is None
    assert emit(req, EOS) is LENGTH


def test_eos_respects_min_tokens():
    req = one(min_tokens=3)
    assert emit(req, EOS) is None
    assert emit(req, EOS) is None
    assert emit(req, EOS) is STOPPED


def test_stop_token_ids_set_the_stop_reason():
    req = one(stop_token_ids=[7, 9])
    assert emit(req, 8) is None
    assert emit(req, 9) is STOPPED and req.stop_reason == 9


def test_stop_token_ids_respect_min_tokens_but_not_ignore_eos():
    req = one(stop_token_ids=[7], min_tokens=2, ignore_eos=True)
    assert emit(req, 7) is None
    assert emit(req, 7) is STOPPED and req.stop_reason == 7


def test_max_tokens_finishes_with_length():
    req = one(max_tokens=2)
    assert emit(req, 5) is None
    assert emit(req, 5) is LENGTH and req.stop_reason is None


def test_eos_on_the_last_allowed_token_is_a_stop():
    req = one(max_tokens=1)
    assert emit(req, EOS) is STOPPED


def test_max_model_len_finishes_with_length():
    req = one(max_tokens=100, prompt_len=6)
    assert emit(req, 5, max_model_len=8) is None
    assert emit(req, 5, max_model_len=8) is LENGTH


def test_scheduler_stops_on_eos_and_frees_the_request():
    sched = make_scheduler()
    runner = FakeRunner(sched.kv)
    (a,) = add(sched, make_group("a", 20, 10))
    (b,) = add(sched, make_group("b", 20, 10, min_tokens=3))
    (c,) = add(sched, make_group("c", 20, 4, ignore_eos=True))
    (d,) = add(sched, make_group("d", 20, 10, stop_token_ids=[42]))
    for rid in "abc":
        for i in range(10):
            runner.forced[rid, i] = EOS
    runner.forced["d", 2] = 42
    run_to_completion(sched, runner)
    assert (a.status, len(a.output_token_ids), a.stop_reason) == (STOPPED, 1, None)
    assert (b.status, len(b.output_token_ids)) == (STOPPED, 3)
    assert (c.status, c.output_token_ids) == (LENGTH, [EOS] * 4)
    assert (d.status, len(d.output_token_ids), d.stop_reason) == (STOPPED, 3, 42)
    assert_all_free(sched)


def test_scheduler_caps_output_at_max_model_len():
    sched = make_scheduler(max_model_len=24)
    runner = FakeRunner(sched.kv)
    (a,) = add(sched, make_group("a", 20, 100))
    p, c = add(sched, make_group("x", 22, 100, n=2))
    run_to_completion(sched, runner)
    assert (a.status, len(a.output_token_ids)) == (LENGTH, 4)
    assert (p.status, len(p.output_token_ids)) == (c.status, len(c.output_token_ids)) == (LENGTH, 2)
    assert_all_free(sched)


def test_fork_child_can_finish_on_its_first_token():
    sched = make_scheduler()
    runner = FakeRunner(sched.kv)
    p, c1, c2 = add(sched, make_group("x", 20, 5, n=3))
    runner.forced["x-1", 0] = EOS
    out = step(sched, runner)
    assert out.fork_children == [c1, c2]
    assert c1.status is STOPPED and c1 not in sched.running and "x-1" not in sched.kv.blocks
    run_to_completion(sched, runner)
    assert p.status is c2.status is LENGTH
    assert_all_free(sched)
