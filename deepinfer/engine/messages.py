"""Wire messages between the API process and the engine process (msgpack via msgspec).

Every struct is `array_like` (encoded as a positional array, no field names) and tagged, so one
decoder per direction tells the messages apart. Invariants of the protocol:

- API -> engine (`InputMessage`): adds, aborts and shutdown, applied in the order sent.
- engine -> API (`OutputMessage`): exactly one `EngineReady` or `EngineFailure` first; then
  `EngineOutputs` / `RequestError` batches; an `EngineFailure` after start-up means the engine is dying.
- `EngineOutput.request_id` is always the PARENT id the API sent; `index` is the sample index.
- A sample's outputs carry each generated token exactly once, in order; the last one has a
  `finish_reason`. A client abort is not echoed back: the client ends its own stream.
"""

from __future__ import annotations

import dataclasses

import msgspec

from deepinfer.sampling_params import SamplingParams

# (token ids, logprobs, rank of the chosen token); column 0 is the chosen (or prompt) token.
LogprobEntry = tuple[list[int], list[float], int]


class _Msg(msgspec.Struct, array_like=True, tag=True):
    """Base: positional encoding, tag = class name."""


# --- API -> engine ---------------------------------------------------------------------------------
class AddRequest(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams fields by name (see params_to_dict); validated in the engine
    priority: int = 0
    arrival_time: float = 0.0  # the client's time.time(); informational, scheduling uses engine arrival
    cache_salt: str | None = None  # requests with different salts never share cached prefix blocks
    kv_transfer: dict | None = None  # disaggregation: the request's kv_transfer_params (docs/disaggregation.md)
    images: list[dict] | None = None  # image spans (multimodal.inputs.ImageSpan.to_wire), placeholders expanded


class AbortRequest(_Msg):
    request_ids: list[str]  # parent ids; every sample of each is aborted ...
    sample_index: int | None = None  # ... or only this sample (a choice that ended on a stop string)


class ResetPrefixCache(_Msg):
    """Forget every cached prefix block (applied in order with the other input messages)."""


class Shutdown(_Msg):
    pass


# --- engine -> API ---------------------------------------------------------------------------------
class EngineReady(_Msg):
    model_type: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    block_size: int
    num_blocks: int
    bytes_per_token: float
    kv_capacity_tokens: int  # num_blocks * block_size: a prompt must be shorter than this too
    max_num_seqs: int


class EngineFailure(_Msg):
    message: str  # why the engine could not start, or why it is exiting


class RequestError(_Msg):
    request_id: str
    message: str
    status: int = 400  # 400: the request was invalid; 500: the engine failed to queue it


class EngineOutput(_Msg):
    request_id: str  # the parent id
    index: int  # sample index in [0, n)
    new_token_ids: list[int]  # raw token ids (EOS / stop token included when it ended the sample)
    logprobs: list[LogprobEntry] | None = None  # one entry per new token when params.logprobs is set
    prompt_logprobs: list[LogprobEntry] | None = None  # rows for prompt tokens 1.. in order, sent once
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop token id that ended the sample, if any
    num_prompt_tokens: int = 0
    error: str | None = None  # set when finish_reason == "error"
    kv_transfer_params: dict | None = None  # prefill engine, final output: what the decode engine is given

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EplbMetrics(_Msg):
    """Live EPLB of a multi-rank engine (distributed.eplb_runtime.EplbCounters; the same on every rank)."""

    rebalances: int
    layers_moved: int
    experts_moved: int
    move_seconds: float  # the slowest rank's wall time inside weight moves
    balancedness_before: list[float]  # per MoE layer, at the last rebalance
    balancedness_after: list[float]


class RankMetrics(_Msg):
    """One rank of a multi-rank engine (distributed.worker.RankStats)."""

    rank: int
    dp_rank: int
    tp_rank: int
    param_bytes: int
    expert_param_bytes: int
    peak_rss_bytes: int
    moe_payload_bytes: int
    steps: int


class ReplicaMetrics(_Msg):
    """One DP replica's scheduler and KV cache."""

    dp_rank: int
    num_running: int
    num_waiting: int
    kv_usage: float


class EngineStats(_Msg):
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of blocks in use, [0, 1]
    num_free_blocks: int
    num_blocks: int
    prompt_tokens_total: int  # prompt tokens of accepted requests (once per parent request)
    generation_tokens_total: int  # tokens sent, over all samples
    num_preemptions: int
    timestamp: float  # engine time.time() when taken
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens whose paged state was found cached
    spec_num_drafts: int = 0  # verification rounds with drafts (speculative decoding)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []  # accepted drafts by position
    replicas: list[ReplicaMetrics] = []  # per DP replica (one entry per replica when data_parallel_size > 1)
    ranks: list[RankMetrics] = []  # per rank, multi-rank engines only
    eplb_balancedness: list[float] = []  # per MoE layer: mean / max tokens per EP rank over the stats window
    eplb: EplbMetrics | None = None  # live EPLB counters (EPLB only)
    eplb_expert_load: list[list[int]] = []  # [MoE layer][logical expert] tokens over the window, all ranks (EP)
    # disaggregation (disagg/connector.TransferStats): prefill holds now, handed off, released, expired;
    # decode transfers received, failed, their bytes and seconds
    kv_transfers_held: int = 0
    kv_transfers_sent: int = 0
    kv_transfers_released: int = 0
    kv_transfer_leases_expired: int = 0
    kv_transfers_received: int = 0
    kv_transfers_failed: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    # image inputs (worker/encoder_cache.py): encoder runs, its seconds, images served from the encoder cache
    images_encoded: int = 0
    image_encoder_seconds: float = 0.0
    image_cache_hits: int = 0


class EngineOutputs(_Msg):
    outputs: list[EngineOutput]
    stats: EngineStats | None = None
    # prefix-cache events since the last message, in order: ("stored" | "evicted", block hash), ("cleared", None)
    kv_events: list[tuple[str, bytes | None]] = []


InputMessage = AddRequest | AbortRequest | ResetPrefixCache | Shutdown
OutputMessage = EngineReady | EngineFailure | RequestError | EngineOutputs

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(InputMessage)
_output_decoder = msgspec.msgpack.Decoder(OutputMessage)


def encode(message: InputMessage | OutputMessage) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes) -> InputMessage:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> OutputMessage:
    return _output_decoder.decode(data)


def params_to_dict(params: SamplingParams) -> dict:
    """Every SamplingParams field by name; `SamplingParams(**d)` rebuilds (and revalidates) it."""
    d = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if params.structured_outputs is not None:
        d["structured_outputs"] = params.structured_outputs.to_dict()
    return d
