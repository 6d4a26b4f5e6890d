"""EngineCore: schedule -> execute -> update, plus request admission and validation."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from deepinfer.config import EngineArgs, ModelConfig, model_dtype
from deepinfer.disagg.connector import build_connector, restore_generator
from deepinfer.engine.kv_cache import KVCacheManager
from deepinfer.engine.outputs import RunnerOutput, SchedulerOutput
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.spec_calibration import calibrate_speculation
from deepinfer.models.loader import iter_checkpoint, quantized_weights
from deepinfer.models.quantized import V3_EXPERT_LEAVES, V4_EXPERT_LEAVES
from deepinfer.models.registry import default_block_size, model_class
from deepinfer.models.weights import tensor_ranges, wanted_names
from deepinfer.quantization.kept import keep_int4
from deepinfer.quantization.spec import check_requested
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec import build_proposer
from deepinfer.worker.compiled_step import build_compiled, use_compiled_steps
from deepinfer.worker.cuda_graphs import build_graphs, longest_position, use_cuda_graphs
from deepinfer.worker.model_runner import CacheLayout, ModelRunner, available_memory_bytes, plan_cache
from deepinfer.worker.threads import set_engine_threads

logger = logging.getLogger("deepinfer")
KEEP_QUANTIZED_ENV = "DEEPINFER_KEEP_QUANTIZED"  # "auto" (default: on CUDA), "1" (on any device), "0" (never)


def load_model(path: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               progress: bool = False, parallel=None) -> torch.nn.Module:
    """The model, built as this rank holds it (parallel: a distributed.model_parallel.ModelParallel; None for
    one process) and loaded from the checkpoint."""
    extra = {} if parallel is None or parallel.is_single else {"parallel": parallel}
    model = model_class(config)(config, dtype=dtype, device=device, **extra)
    # A sharded model's rank reads only the tensors it stores, and of TP-split plain tensors only its block; a
    # single-process model wants every tensor whole.
    wanted, skipped = wanted_names(model), getattr(model, "skips_tensor", None)
    if skipped is not None:  # tensors the model reads itself (memory-mapped tables) or does not use
        wanted = (lambda w: lambda name: w(name) and not skipped(name))(wanted)
    keep = _keep_quantized(model, path, config, device, parallel)
    sink = {} if _keeps_int4(config, parallel) else None
    model.load_weights(iter_checkpoint(path, config.model_type, block_size=config.weight_block_size,
                                       progress=progress, wanted=wanted, ranges=tensor_ranges(model),
                                       keep_quantized=keep, int4=config.quantization, int4_sink=sink))
    if sink:
        keep_int4(model, sink, V4_EXPERT_LEAVES if config.is_v4 else V3_EXPERT_LEAVES)
    if hasattr(model, "attach_checkpoint"):
        model.attach_checkpoint(path)
    return model.eval().requires_grad_(False)  # inference only: no autograd state in any step or graph


def _keeps_int4(config: ModelConfig, parallel) -> bool:
    """Int4 weights (AWQ, GPTQ without act order) stay packed in memory on one process unless
    DEEPINFER_KEEP_QUANTIZED=0 (then, and under TP / EP, they are dequantised at load)."""
    one = parallel is None or parallel.is_single
    return config.quantization is not None and one and os.environ.get(KEEP_QUANTIZED_ENV) != "0"


def _keep_quantized(model: torch.nn.Module, path: str | Path, config: ModelConfig, device: torch.device,
                    parallel=None):
    """The loader's keep_quantized predicate: a single-process model that supports it keeps the checkpoint's
    quantised weights quantised on CUDA (DEEPINFER_KEEP_QUANTIZED=1: on any device; =0: never). None: every
    weight is dequantised at load, as on CPU and under TP / EP."""
    mode = os.environ.get(KEEP_QUANTIZED_ENV, "auto")
    if not (mode == "1" or (mode == "auto" and torch.device(device).type == "cuda")):
        return None
    quantized = quantized_weights(path, config.model_type)
    if quantized and (not hasattr(model, "keep_quantized_weights") or not (parallel is None or parallel.is_single)):
        logger.info("quantised weights are dequantised at load (kept quantised only on one process, V2/V3/V4)")
        return None
    return model.keep_quantized_weights(quantized) if quantized else None


def effective_args(args: EngineArgs | None) -> EngineArgs:
    """Options that other options rule out, switched off once (and said so)."""
    args = args or EngineArgs()
    if args.speculative is not None and args.async_scheduling:
        logger.info("speculative decoding runs synchronous steps: async scheduling is off")
        args = replace(args, async_scheduling=False)
    if args.disaggregation_mode != "none" and args.async_scheduling:
        logger.info("disaggregated engines run synchronous steps: async scheduling is off")
        args = replace(args, async_scheduling=False)
    return args


def prepare_model(model: torch.nn.Module, args: EngineArgs) -> None:
    model.kv_cache_dtype = args.kv_cache_dtype
    if args.speculative is not None:  # rings keep room to roll back every draft of a step
        model.num_lookahead_tokens = args.speculative.num_speculative_tokens
    if args.prefill_truncation_tokens:
        if not hasattr(model, "enable_prefill_truncation"):
            raise ValueError("prefill_truncation_tokens is a DeepSeek-V4.1 option (its late layers read the shared "
                             "compressed KV); this model has no such layers")
        model.enable_prefill_truncation(args.prefill_truncation_tokens, model.num_lookahead_tokens)


def cache_specs(model: torch.nn.Module, args: EngineArgs, block_size: int):
    """The model's cache tensors, and a draft MTP layer's (or V4.1's own DSpark stages') when it drafts."""
    if args.speculative is not None and (args.speculative.method == "mtp" or _own_dspark(model, args)):
        return model.kv_cache_spec(block_size, include_mtp=True)
    return model.kv_cache_spec(block_size)


def _own_dspark(model: torch.nn.Module, args: EngineArgs) -> bool:
    from deepinfer.spec.dspark_v41 import has_own_dspark

    return args.speculative is not None and args.speculative.method == "dspark" and has_own_dspark(model)


def replay_tokens(model: torch.nn.Module, args: EngineArgs) -> int:
    """A drafting MTP layer sits on top of the stack: one more window to rebuild at a prefix hit. V4.1's DSpark
    rings hold W positions of main-model KV, each from taps at most the deepest target layer deep."""
    replay = model.prefix_replay_tokens()
    if replay and args.speculative is not None and args.speculative.method == "mtp":
        replay += model.config.sliding_window - 1
    if replay and _own_dspark(model, args) and model.config.v41.dspark is not None:
        w = model.config.sliding_window
        replay = max(replay, (max(model.config.v41.dspark.target_layer_ids) + 1) * (w - 1) + w - 1)
    return replay


def plan_layout(model: torch.nn.Module, args: EngineArgs, max_model_len: int, device: torch.device) -> CacheLayout:
    """Split this device's KV budget into blocks, state slots and snapshot rows."""
    block_size = args.block_size or default_block_size(model.config)
    specs = cache_specs(model, args, block_size)
    budget = args.kv_cache_memory_bytes
    if budget is None:
        fraction = args.gpu_memory_utilization if device.type == "cuda" else args.cpu_kv_cache_fraction
        budget = int(available_memory_bytes(device) * fraction)
    useful = args.max_num_seqs * -(-max_model_len // block_size)
    return plan_cache(specs, block_size, args.max_num_seqs, budget, useful, _num_snapshots(model, args, specs, budget))


def _num_snapshots(model: torch.nn.Module, args: EngineArgs, specs, budget: int) -> int:
    """State rows for prefix-hit snapshots: none for replay (or models without bounded state); `auto`
    keeps them only while they cost at most a tenth of the KV budget."""
    if not args.enable_prefix_caching or args.swa_restore == "replay" or not model.prefix_replay_tokens():
        return 0
    count = args.num_prefix_snapshots or 2 * args.max_num_seqs
    per_slot = sum(s.bytes_per_unit for s in specs if s.kind == "state")
    return count if args.swa_restore == "snapshot" or count * per_slot <= budget // 10 else 0


class EngineCore:
    """One scheduler and KV manager. `runner` None: the model runs in this process; otherwise a remote runner
    (distributed.executor.ReplicaRunner) standing for a DP replica's ranks, with its `layout` and
    `replay_tokens` already agreed by them."""

    def __init__(self, model: str | Path, args: EngineArgs | None = None, runner=None):
        args = effective_args(args)
        self.args = args
        self.model_path = Path(model)
        self.structured = None  # StructuredOutputManager, created with the first constrained request
        self._structured_warmup: threading.Thread | None = None
        self.device = torch.device(args.device)
        self.model_config = ModelConfig.from_hf(model)
        check_requested(args.quantization, self.model_config.quantization)
        self.dtype = model_dtype(args.dtype, self.model_config, self.device.type)
        self.speculative = args.speculative
        self.max_model_len = args.max_model_len or self.model_config.max_position
        if runner is None:
            runner = self._local_runner(model)
        self.runner, self.layout = runner, runner.layout
        logger.info(self.layout.describe())
        if self.layout.num_tokens < self.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: outputs are capped to fit",
                           self.layout.num_tokens, self.max_model_len)
        self.kv = KVCacheManager(self.layout.num_blocks, self.layout.block_size, self.layout.num_state_slots,
                                 args.enable_prefix_caching, self.layout.num_snapshot_slots)
        self.scheduler = Scheduler(args.scheduler_config(self.max_model_len), self.kv, self.max_model_len,
                                   replay_tokens=runner.replay_tokens, speculative=self.speculative)
        self.last_result = RunnerOutput()
        self.last_scheduled = SchedulerOutput()
        # Async scheduling: forwards run in order on one worker thread; `in_flight` is the step submitted
        # last, whose tokens the next step() call folds in.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-forward") if args.async_scheduling else None
        self.in_flight: tuple[SchedulerOutput, Future] | None = None
        self.connector = build_connector(self)  # disaggregation (disagg/connector.py); None when colocated
        if self.speculative is not None and self.speculative.verify_policy == "adaptive":
            calibrate_speculation(self)

    @property
    def executor(self):
        """The ranks' distributed.executor.Executor, or None when the model runs in this process."""
        return getattr(self.runner, "executor", None)

    def _local_runner(self, model: str | Path) -> ModelRunner:
        args = self.args
        set_engine_threads(self.device, args.cpu_threads)
        torch.manual_seed(args.seed)
        self.model = load_model(model, self.model_config, self.dtype, self.device, args.load_progress)
        prepare_model(self.model, args)
        self.proposer = build_proposer(self.speculative, self.model, model)
        graphed = use_cuda_graphs(self.model, args, self.device, self.proposer)
        compiled = use_compiled_steps(self.model, args, self.device, self.proposer)
        if graphed or compiled:  # before the KV budget is sized from free memory
            self.model.grow_rope(longest_position(self.model, self.max_model_len))
        layout = plan_layout(self.model, args, self.max_model_len, self.device)
        runner = ModelRunner(self.model, layout, self.device, args.deterministic, args.seed, self.proposer,
                             cache_specs(self.model, args, layout.block_size), scratch_rows=int(graphed or compiled))
        runner.replay_tokens = replay_tokens(self.model, args)
        if graphed or compiled:
            runner.graphs = (build_graphs if graphed else build_compiled)(runner, args, self.max_model_len)
            runner.graphs.capture_all(args.load_progress)
        return runner

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None, kv_transfer: dict | None = None,
                    images: list | None = None) -> list[Request]:
        """Validate and queue; returns the n sample requests. Raises ValueError and queues nothing.
        images: multimodal.inputs.ImageSpan per image span of the prompt (placeholders already expanded)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id}: sampling params must be SamplingParams, got {type(params)}")
        max_out = self.validate_request(request_id, prompt_token_ids, params)
        images = tuple(images or ())
        self.validate_images(request_id, prompt_token_ids, images, kv_transfer)
        if kv_transfer and not (kv_transfer.get("do_remote_decode") or kv_transfer.get("remote_bootstrap")):
            kv_transfer = None  # e.g. vLLM's {"do_remote_decode": false}: a colocated request
        if kv_transfer:
            max_out = self._validate_transfer(request_id, kv_transfer, params, max_out)
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        if any(i in self.scheduler.requests or i in self.scheduler.loading for i in ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        requests = []
        for i, rid in enumerate(ids):
            req = Request(rid, list(prompt_token_ids), params, max_out, priority=priority,
                          eos_token_ids=self.model_config.eos_token_ids, sample_index=i,
                          fork_of=requests[0] if i else None, cache_salt=cache_salt, kv_transfer=kv_transfer,
                          images=images)
            if params.structured_outputs is not None:  # each sample advances its own matcher
                req.grammar = self.structured.request_state(params.structured_outputs)
            requests.append(req)
            self.scheduler.add(req)
        return requests

    def validate_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> int:
        """The request's output cap, or ValueError naming what is wrong; touches no state."""
        n = len(prompt)
        if n == 0:
            raise ValueError(f"request {request_id}: the prompt is empty")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token id {bad[0]!r} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(f"request {request_id}: the prompt has {n} tokens but the model's context is "
                             f"{self.max_model_len} tokens (at least one must be left for the output)")
        capacity = min(self.max_model_len, self.layout.num_tokens)
        if n >= capacity:
            raise ValueError(f"request {request_id}: {n} prompt tokens cannot fit in the KV cache "
                             f"({self.layout.num_tokens} tokens) with room for an output token")
        if params.structured_outputs is not None:
            self._structured_manager().validate(params.structured_outputs)
        if params.prompt_logprobs is not None and self.args.prefill_truncation_tokens:
            raise ValueError(f"request {request_id}: prompt_logprobs cannot be combined with prefill truncation "
                             "(the truncated layers skip most prompt positions)")
        room = capacity - n  # a request alone always fits, so preemption always makes progress
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def validate_images(self, request_id: str, prompt: list[int], images: tuple, kv_transfer: dict | None) -> None:
        """Image spans need a vision checkpoint, must match the prompt's image tokens, and each must fit one step
        (a chunk never splits a span)."""
        v41 = self.model_config.v41
        vision = v41.vision if v41 is not None else None
        if not images:
            if vision is not None and v41.image_token_id in prompt:
                raise ValueError(f"request {request_id}: the prompt holds image tokens ({v41.image_token_id}) "
                                 "but no images were given")
            return
        if vision is None:
            raise ValueError(f"request {request_id}: this model takes no image inputs (its checkpoint has no vision "
                             "tower)")
        if kv_transfer:
            raise ValueError(f"request {request_id}: image inputs cannot be combined with disaggregated prefill")
        if self.args.parallel.world_size > 1:  # the rank processes' request mirrors carry no images
            raise ValueError(f"request {request_id}: image inputs need a one-process engine (world size 1)")
        from deepinfer.multimodal.inputs import check_spans

        check_spans(prompt, list(images), v41.image_token_id, vision)
        longest = max(s.length for s in images)
        if longest > self.args.max_num_batched_tokens:  # chunked or not, a span goes into one step whole
            raise ValueError(f"request {request_id}: an image of {longest} tokens does not fit one step "
                             f"(max_num_batched_tokens {self.args.max_num_batched_tokens}); image spans are "
                             "prefilled whole")

    def _validate_transfer(self, request_id: str, kv_transfer: dict, params: SamplingParams, max_out: int) -> int:
        """The output cap of a disaggregated request (a prefill engine samples only the first token), or
        ValueError when this engine's role cannot serve it."""
        mode = self.args.disaggregation_mode
        wants = "prefill" if kv_transfer.get("do_remote_decode") else "decode"
        if wants != mode:
            raise ValueError(f"request {request_id}: kv_transfer_params are for a {wants} engine; this engine's "
                             f"disaggregation mode is {mode!r}")
        if wants == "decode" and not isinstance(kv_transfer.get("transfer_id"), str):
            raise ValueError(f"request {request_id}: kv_transfer_params has no transfer_id")
        if params.n != 1 or params.prompt_logprobs is not None:
            raise ValueError(f"request {request_id}: disaggregated requests take n=1 and no prompt_logprobs")
        return 1 if wants == "prefill" else max_out

    def warm_structured_outputs(self) -> None:
        """Build the structured-output manager on a background thread now (its tokenizer tables take about a
        second), so the first constrained request does not stall every running request's next step."""
        if self._structured_warmup is None and (self.model_path / "tokenizer.json").is_file():
            self._structured_warmup = threading.Thread(target=self._warm_structured, daemon=True,
                                                       name="deepinfer-structured-warmup")
            self._structured_warmup.start()

    def _warm_structured(self) -> None:
        try:
            self._build_structured()
        except Exception:  # the first constrained request builds it again and reports the error
            logger.debug("structured-output warm-up failed", exc_info=True)

    def _structured_manager(self):
        """xgrammar is imported (and the tokenizer loaded) only once a request asks for a constraint, unless
        warm_structured_outputs built it already."""
        if self._structured_warmup is not None:
            self._structured_warmup.join()
        return self._build_structured()

    def _build_structured(self):
        if self.structured is None:
            from deepinfer.structured.manager import StructuredOutputManager
            from deepinfer.tokenizer import Tokenizer

            if not (self.model_path / "tokenizer.json").is_file():
                raise ValueError("structured outputs need the model's tokenizer.json, which this checkpoint lacks")
            self.structured = StructuredOutputManager(
                Tokenizer.from_dir(self.model_path), self.model_config.vocab_size, self.model_config.eos_token_ids,
                timeout_s=self.args.grammar_compile_timeout_s,
                closing_margin=None if self.args.grammar_closing_margin < 0 else self.args.grammar_closing_margin)
        return self.structured

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        return self.scheduler.finish(request_id, status)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self.in_flight is not None

    # --- stepping ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; returns every request whose state changed (finished ones included).

        Async: submit this step's forward, then fold in the previous step's tokens while it runs, so the
        requests returned are those of the previous step (the step's own show up on the next call).
        """
        if self._worker is not None:
            return self._step_async()
        arrived = self.service_transfers()
        if arrived:  # a step of its own, so each arrival's first token and logprobs come out alone
            return arrived
        started = time.perf_counter()
        failed, out = self.begin_step()
        self._start_loads(out)
        if out.is_empty:
            self.last_result = RunnerOutput()
            if self.scheduler.receiving:
                self.connector.wait(0.005)  # nothing to compute until a transfer ends
            return failed
        return failed + self.end_step(out, self.runner.execute(out), started)

    # --- disaggregation ------------------------------------------------------------------------
    def service_transfers(self) -> list[Request]:
        """Prefill: end released and expired holds. Decode: fold in finished transfers; returns the requests
        whose cache arrived (their first token is out) or whose transfer failed. Call between steps."""
        if self.connector is None:
            return []
        if self.connector.role == "prefill":
            self.connector.service()
            return []
        touched, logprobs = [], {}
        for event in self.connector.poll():
            req = self._apply_load_safely(event)
            if req is not None:
                touched.append(req)
                if event.record and event.record.get("logprobs") is not None:
                    logprobs[req.request_id] = tuple(event.record["logprobs"])
        if touched:
            self.last_scheduled, self.last_result = SchedulerOutput(), RunnerOutput(logprobs=logprobs)
        return touched

    def _apply_load_safely(self, event) -> Request | None:
        """A malformed record fails only its own request."""
        try:
            return self._apply_load(event)
        except Exception as e:
            logger.exception("applying the KV transfer of %s failed", event.request_id)
            if event.request_id not in self.scheduler.receiving:
                return None
            return self.scheduler.remote_failed(event.request_id, f"KV transfer failed: {type(e).__name__}: {e}")

    def _apply_load(self, event) -> Request | None:
        if event.kind == "ended":
            self.scheduler.load_ended(event.request_id)
            return None
        if event.kind == "failed":
            return self.scheduler.remote_failed(event.request_id, event.error)
        req = self.scheduler.receiving.get(event.request_id)
        if req is not None:
            restore_generator(req, event.record)
        return self.scheduler.remote_arrived(event.request_id, event.record["first_token"], event.record["drafts"])

    def _start_loads(self, out: SchedulerOutput) -> None:
        for load in out.kv_loads:
            self.connector.start(load)

    def _hold_sent(self, result: RunnerOutput) -> None:
        """Prefill: requests that finished their prompt this step keep their cache for the decode engine."""
        for req in self.scheduler.sent:
            req.kv_transfer_params = self.connector.sent(req, result)
        self.scheduler.sent.clear()

    def begin_step(self) -> tuple[list[Request], SchedulerOutput]:
        """Synchronous step, first half: requests failed before scheduling, and what to compute."""
        failed = self._fail_grammars()
        out = self.last_scheduled = self.scheduler.schedule()
        if not out.is_empty and self.structured is not None:  # filled on a worker thread while the forward runs
            out.grammar_bitmask = self.structured.fill_async(_sampling_requests(out), _drafts(out))
        return failed, out

    def end_step(self, out: SchedulerOutput, result: RunnerOutput, started: float) -> list[Request]:
        """Synchronous step, second half: fold the runner's result in; returns the requests it changed."""
        self.last_result = result
        touched = self.scheduler.update(out, result)
        self._hold_sent(result)
        self.scheduler.record_step(out, result, time.perf_counter() - started)
        return touched

    def _fail_grammars(self) -> list[Request]:
        """Waiting requests whose grammar failed to compile (or hit the time limit) finish with an error."""
        if self.structured is None:
            return []
        failed = [r for r in self.scheduler.waiting if r.grammar is not None and r.grammar.ready()
                  and r.grammar.error is not None]
        for req in failed:
            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
            req.stop_reason = req.grammar.error
        return failed

    def _step_async(self) -> list[Request]:
        failed = self._fail_grammars()
        out = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        if not out.is_empty:
            if self.structured is not None:  # masks need the previous step's tokens: resolved after its update
                out.grammar_bitmask = Future()
            self.in_flight = (out, self._submit(out))
        try:
            if previous is None:
                self.last_scheduled, self.last_result = SchedulerOutput(), RunnerOutput()
                return failed
            self.last_scheduled = previous[0]
            self.last_result = self._result(previous[1])
            return failed + self.scheduler.update(previous[0], self.last_result)
        finally:
            self._fill_masks(out)

    def _submit(self, out: SchedulerOutput) -> Future:
        """The step's forward, started: on the forward thread, or (ranks) sent to them at once."""
        submit = getattr(self.runner, "submit", None)
        return submit(out) if submit is not None else self._worker.submit(self.runner.execute, out)

    def _fill_masks(self, out: SchedulerOutput) -> None:
        """Async: resolve the in-flight step's bitmask once its requests' matchers hold every known token
        (its forward runs meanwhile; the sampler waits for this)."""
        pending = out.grammar_bitmask
        if pending is None or pending.done():
            return
        try:
            pending.set_result(self.structured.fill(_sampling_requests(out), _drafts(out)))
        except Exception as e:
            pending.set_exception(e)

    def _result(self, future: Future) -> RunnerOutput:
        """A failed forward also fails the step queued behind it (its placeholders cannot resolve)."""
        try:
            return future.result()
        except Exception:
            if self.in_flight is not None:
                queued, self.in_flight = self.in_flight, None
                _abandon_masks(queued[0])  # its sampler must not wait for masks that will never come
                _settle(queued[1])
                self.last_scheduled = _merged(self.last_scheduled, queued[0])
            raise

    def settle(self) -> None:
        """Wait for the step in flight, if any, to end (its tokens are dropped)."""
        if self.in_flight is not None:
            _settle(self.in_flight[1])
            self.in_flight = None

    def shutdown(self) -> None:
        """Finish the step in flight (its tokens are dropped), stop the worker thread and any ranks."""
        self.settle()
        if self.connector is not None:
            self.connector.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        if self._worker is not None:
            self._worker.shutdown()


def _settle(future: Future) -> None:
    """Wait for a step's forward to end, however it ends (result() also collects a rank step's answer)."""
    try:
        future.result()
    except Exception:
        pass


def _sampling_requests(out: SchedulerOutput) -> list[Request]:
    return [s.request for s in out.scheduled if s.samples] + out.fork_children


def _drafts(out: SchedulerOutput) -> dict[str, list[int]]:
    return {s.request.request_id: s.draft_token_ids for s in out.scheduled if s.num_drafts}


def _abandon_masks(out: SchedulerOutput) -> None:
    if out.grammar_bitmask is not None and not out.grammar_bitmask.done():
        out.grammar_bitmask.set_exception(RuntimeError("the previous step failed"))


def _merged(a: SchedulerOutput, b: SchedulerOutput) -> SchedulerOutput:
    return SchedulerOutput(a.scheduled + b.scheduled, a.forks + b.forks, a.fork_children + b.fork_children)
