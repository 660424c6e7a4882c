"""The README's "Send your first request" examples, run as written against the session's live `kvflow serve`.

Only what differs from a plain `make serve` is substituted: that server's ports and its API key (each substitution
must apply, so an edited example fails here rather than going untested)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.serve import API_KEY, Server

README = Path(__file__).resolve().parents[2] / "README.md"


def first_request_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the README's "Send your first request" section."""
    text = README.read_text()
    section = text.split("## Send your first request", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(bash|python)\n(.*?)```", section, flags=re.S)


def substituted(code: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert old in code, f"the README example no longer contains {old!r}:\n{code}"
        code = code.replace(old, new)
    return code


def test_the_section_has_curl_openai_and_grpc_examples() -> None:
    blocks = first_request_blocks()
    assert [language for language, _ in blocks] == ["bash", "python", "python"]
    assert "curl" in blocks[0][1] and "OpenAI(" in blocks[1][1] and "Client(" in blocks[2][1]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["curl", "openai-sdk", "grpc-sdk"])
def test_a_readme_request_example_answers(server: Server, index: int) -> None:
    language, code = first_request_blocks()[index]
    http = f"http://127.0.0.1:{server.port}"
    if language == "bash":
        code = substituted(code, [("http://127.0.0.1:8000", http),
                                  ("curl -s", f"curl -s -H 'Authorization: Bearer {API_KEY}'")])
        done = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=120)
    elif "OpenAI(" in code:
        code = substituted(code, [("http://127.0.0.1:8000", http), ('api_key="EMPTY"', f'api_key="{API_KEY}"')])
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    else:
        code = substituted(code, [('Client("127.0.0.1:50051")',
                                   f'Client("127.0.0.1:{server.grpc_port}", api_key="{API_KEY}")')])
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout, done.stdout  # greedy: SmolLM2's known answer
