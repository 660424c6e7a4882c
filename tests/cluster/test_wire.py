"""The one conversion between engine sampling parameters and the wire: every field round-trips, in both modes."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.wire import sampling_kwargs_from_proto, sampling_params_from_proto, sampling_params_to_proto
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from engine.structured.grammar import StructuredOutputsParams
from protos.kvflow.v1 import kvflow_pb2 as pb

# A value unlike the default for every field (a new field without one here fails the coverage test below).
NON_DEFAULT = dict(n=3, temperature=0.25, top_p=0.5, top_k=7, min_p=0.125, presence_penalty=0.5,
                   frequency_penalty=-0.5, repetition_penalty=1.25, seed=11, stop=["x", "yz"], stop_token_ids=[5, 9],
                   include_stop_str_in_output=True, ignore_eos=True, max_tokens=40, min_tokens=2, logprobs=3,
                   prompt_logprobs=1, skip_special_tokens=False, logit_bias={3: -100.0, 70000: 2.5},
                   structured_outputs=StructuredOutputsParams(json='{"type":"object"}', disable_any_whitespace=True),
                   allowed_token_ids=[4, 8], bad_words=["darn it", "heck"])


def test_every_sampling_field_is_covered() -> None:
    fields = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
    assert fields == set(NON_DEFAULT), "a sampling field is missing from this round-trip test"


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_each_field_round_trips_alone_in_both_modes(name: str) -> None:
    params = SamplingParams(**{name: NON_DEFAULT[name]})
    for explicit_only in (True, False):
        back = sampling_params_from_proto(sampling_params_to_proto(params, explicit_only))
        assert getattr(back, name) == NON_DEFAULT[name], (name, explicit_only)
    # Only what was set travels in explicit mode (plus n), so generation-config defaults still apply there.
    assert set(sampling_kwargs_from_proto(sampling_params_to_proto(params, True))) <= {name, "n"}


def test_all_fields_round_trip_together() -> None:
    back = sampling_params_from_proto(sampling_params_to_proto(SamplingParams(**NON_DEFAULT)))
    for name, value in NON_DEFAULT.items():
        assert getattr(back, name) == value, name


def test_non_finite_values_from_the_wire_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="temperature"):
        sampling_params_from_proto(pb.SamplingParams(temperature=float("nan")))
    with pytest.raises(InvalidRequest, match="top_p"):
        sampling_params_from_proto(pb.SamplingParams(top_p=float("inf")))
