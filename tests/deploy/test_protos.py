"""The committed stubs match the .proto files, and the contract keeps its style rules."""

from __future__ import annotations

import re
from pathlib import Path

from protos.generate import PROTO_FILES, ROOT, generate


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    for proto in PROTO_FILES:
        stem = Path(proto).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            fresh = (tmp_path / f"{stem}{suffix}").read_text()
            committed = (ROOT / f"{stem}{suffix}").read_text()
            assert fresh == committed, f"{stem}{suffix} is stale: run python -m protos.generate"


def test_enum_zero_values_are_unspecified() -> None:
    text = (ROOT / PROTO_FILES[0]).read_text()
    for name, body in re.findall(r"enum (\w+) \{([^}]*)\}", text):
        first = re.search(r"(\w+)\s*=\s*0;", body)
        assert first is not None and first.group(1).endswith("_UNSPECIFIED"), name


def test_roundtrip_generate_request() -> None:
    from protos.kvflow.v1 import kvflow_pb2 as pb

    request = pb.GenerateRequest(request_id="r1", token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                 sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=4))
    decoded = pb.GenerateRequest.FromString(request.SerializeToString())
    assert decoded.WhichOneof("input") == "token_ids"
    assert list(decoded.token_ids.ids) == [1, 2, 3]
    assert decoded.sampling_params.HasField("temperature") and decoded.sampling_params.temperature == 0.0
