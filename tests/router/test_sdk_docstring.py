"""The SDK's module docstring example (kvflow/client.py), run as written against a real router in front of fake
workers (tests/helpers/router_fakes.py): the streamed answer is printed once (issue #28, item 4)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import textwrap

import kvflow.client
from kvflow.client import AsyncClient, Chunk, GenerateResult
from tests.helpers.router_fakes import RouterHarness

DOC_TARGET = "127.0.0.1:50051"


def _example() -> str:
    """The docstring's indented code block."""
    doc = kvflow.client.__doc__ or ""
    start = doc.index("    from kvflow.client import Client")
    block = doc[start:].split("\n\n", 1)[0]
    return textwrap.dedent(block)


def test_docstring_example_prints_the_answer_once(router: RouterHarness) -> None:
    code = _example()
    assert DOC_TARGET in code and "generate_stream" in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(DOC_TARGET, router.grpc_address), "kvflow.client docstring", "exec"), {})
    # The fake decode worker answers "ok": once for generate, once streamed, then the final line.
    assert out.getvalue() == "ok\nok [length, 1 tokens]\n", out.getvalue()


def test_stream_items_tell_the_final_result_apart(router: RouterHarness) -> None:
    async def run() -> list[Chunk | GenerateResult]:
        async with AsyncClient(router.grpc_address) as client:
            return [item async for item in client.generate_stream([1, 2, 3], max_tokens=2)]

    items = asyncio.run(run())
    assert [item.final for item in items] == [False] * (len(items) - 1) + [True]
    assert isinstance(items[-1], GenerateResult) and all(isinstance(item, Chunk) for item in items[:-1])
    assert "".join(item.text for item in items if not item.final) == items[-1].text
