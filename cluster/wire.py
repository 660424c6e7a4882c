"""Conversions between engine types and the wire contract (protos/kvflow/v1), in one place for every service.

Sampling parameters convert field by field from `SamplingParams`'s own dataclass fields and the message
descriptor: a field added to both converts everywhere without touching this file. Proto names equal engine
names, except `skip_special_tokens`, which the wire carries negated so that proto3's default (false) keeps
vLLM's default (true).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.errors import InvalidRequest
from engine.kv_layout import KVLayout
from engine.outputs import Logprob, PositionLogprobs
from engine.sampling_params import SamplingParams
from engine.structured.grammar import StructuredOutputsParams
from protos.kvflow.v1 import kvflow_pb2 as pb

# The largest gRPC message any kvflow process sends or accepts (worker servers, the router's worker channels): a
# Generate response with many logprobs, a KV chunk (4 MiB on the gRPC path) and room to spare.
MAX_MESSAGE_BYTES = 64 << 20
# Finish reasons: the engine's (vLLM's) strings <-> the proto enum; FINISH_REASON_UNSPECIFIED has no string
FINISH_REASON_TO_PROTO = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                          "abort": pb.FINISH_REASON_ABORT}
FINISH_REASON_FROM_PROTO = {code: name for name, code in FINISH_REASON_TO_PROTO.items()}

_NEGATED = {"skip_special_tokens": "skip_special_tokens_false"}
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_"))
_MESSAGE_FIELDS = pb.SamplingParams.DESCRIPTOR.fields_by_name
_MISSING = [n for n in _SAMPLING_FIELDS if _NEGATED.get(n, n) not in _MESSAGE_FIELDS]
if _MISSING:  # import-time contract check: the proto must carry every sampling parameter
    raise RuntimeError(f"protos SamplingParams lacks {_MISSING}")



def _is_repeated(field: Any) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6
        return bool(field.is_repeated)
    return field.label == field.LABEL_REPEATED


_REPEATED = {name for name, field in _MESSAGE_FIELDS.items() if _is_repeated(field)}


# ---- sampling parameters ---------------------------------------------------------------------------------------
def structured_outputs_to_proto(params: StructuredOutputsParams) -> pb.StructuredOutputs:
    out = pb.StructuredOutputs(disable_any_whitespace=params.disable_any_whitespace)
    kind = params.kind
    if kind == "json":
        out.json = params.schema_text()
    elif kind == "choice":
        out.choice.choices.extend(params.choice or [])
    elif kind == "json_object":
        out.json_object = True
    else:
        setattr(out, kind, getattr(params, kind))
    return out


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("structured_outputs sets no constraint", "structured_outputs")
    value: Any = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputsParams(**{kind: value}, disable_any_whitespace=msg.disable_any_whitespace)


# Message-typed sampling fields: (engine -> proto, proto -> engine).
_MESSAGES = {"structured_outputs": (structured_outputs_to_proto, structured_outputs_from_proto)}


def sampling_kwargs_from_proto(msg: pb.SamplingParams) -> dict[str, Any]:
    """The fields the sender set, as `SamplingParams` keyword arguments (unset ones keep engine defaults, and
    generation-config defaults may fill them, as in vLLM)."""
    kwargs: dict[str, Any] = {}
    for name in _SAMPLING_FIELDS:
        wire_name = _NEGATED.get(name, name)
        value = getattr(msg, wire_name)
        if wire_name in _REPEATED:  # repeated fields and maps: empty means "not set"
            if value:
                kwargs[name] = dict(value) if hasattr(value, "items") else list(value)
        elif _MESSAGE_FIELDS[wire_name].has_presence:
            if msg.HasField(wire_name):
                kwargs[name] = _MESSAGES[name][1](value) if name in _MESSAGES else value
        elif value:  # plain proto3 scalars: the zero value means "not set"
            kwargs[name] = not value if name in _NEGATED else value
    for name, value in kwargs.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number, got {value}")
    return kwargs


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(**sampling_kwargs_from_proto(msg))


def sampling_params_to_proto(params: SamplingParams, explicit_only: bool = False) -> pb.SamplingParams:
    """`explicit_only`: only what the caller set, plus n (the router's HTTP and gRPC fronts and the SDK, so the
    worker's generation-config defaults fill the rest); otherwise every effective value (a decode worker asking a
    prefill worker to sample the first token exactly as it would)."""
    out = pb.SamplingParams()
    for name in _SAMPLING_FIELDS:
        if explicit_only and name != "n" and name not in params._explicit:
            continue
        value = getattr(params, name)
        if value is None:
            continue
        if name in _NEGATED:
            setattr(out, _NEGATED[name], not value)
        elif name in _MESSAGES:
            getattr(out, name).CopyFrom(_MESSAGES[name][0](value))
        elif isinstance(value, dict):
            getattr(out, name).update(value)
        elif isinstance(value, list):
            getattr(out, name).extend(value)
        else:
            setattr(out, name, value)
    return out


# ---- logprobs --------------------------------------------------------------------------------------------------
def logprobs_to_proto(token_id: int, entry: PositionLogprobs) -> pb.TokenLogprob:
    chosen = entry.get(token_id)
    top = [pb.TopLogprob(token_id=t, logprob=lp.logprob, rank=lp.rank, token=lp.decoded_token or "")
           for t, lp in entry.items()]
    return pb.TokenLogprob(token_id=token_id, logprob=chosen.logprob if chosen else 0.0,
                           rank=chosen.rank if chosen else 0, top=top)


def logprobs_from_proto(msg: pb.TokenLogprob) -> PositionLogprobs:
    entry = {t.token_id: Logprob(t.logprob, t.rank, t.token or None) for t in msg.top}
    entry.setdefault(msg.token_id, Logprob(msg.logprob, msg.rank))
    return entry


# ---- KV layout -------------------------------------------------------------------------------------------------
def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(dtype=layout.dtype, num_layers=layout.num_layers, block_size=layout.block_size,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, order=layout.order,
                       kv_scales=layout.kv_scales)


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.dtype, msg.num_layers, msg.block_size, msg.num_kv_heads, msg.head_dim, msg.order,
                    tuple(msg.kv_scales))
