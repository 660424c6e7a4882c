"""Request-supplied chat templates (`--trust-request-chat-template`), rendered in child processes that are killed at
the deadline.

Why processes: a render in a router thread is stopped at its deadline only between Python lines
(`render_with_deadline`); C-level work such as `{{ (7 ** 14000000) % 7 }}` holds the GIL, so the router's event loop
(`/health` included) froze for the whole 12.5 s. A child process is killed instead, and the event loop only waits on
a pipe.

Invariants:
- A render gets `timeout_s` in the child (Python-level loops stop there and the child lives on) and is killed at
  `timeout_s + KILL_GRACE_S` from the parent (C-level work); either way the request fails with InvalidRequest naming
  `chat_template`. A killed, crashed or abandoned (the client left) child is replaced at once, in the background.
- Parent and child exchange one JSON line each way (plain messages, tools and kwargs; no pickle).
- A child renders one template at a time; a request waits for a free one (cancellable, as the client may leave).
- A child holds at most its tokenizer plus MEMORY_HEADROOM_BYTES (address space), so a memory bomb fails in the
  child, and it refuses a rendered prompt longer than the request's `max_chars` rather than ship it back.

Templates from the model keep the thread path (router/tokenizer_pool.py): the operator chose them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequest
from engine.process.lifeline import die_with_parent_if_asked, lifeline_env

KILL_GRACE_S = 0.5  # beyond the render deadline: the child's own Python-level stop comes first when it can
STARTUP_TIMEOUT_S = 120.0  # a child loads transformers and the tokenizer (about 3 s on a quiet 2-core host)
MEMORY_HEADROOM_BYTES = 2 << 30  # address space a child may add once its tokenizer is loaded
_REPLY_LIMIT_BYTES = 1 << 30  # a reply line's buffer bound (the child already caps the text at max_chars)
_ROOT = str(Path(__file__).resolve().parent.parent)  # the checkout that holds `router`, for the child's imports


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (_ROOT, env.get("PYTHONPATH"))))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(lifeline_env())  # the kernel ends the child with the router, even mid-render
    return env


class _Worker:
    """One child process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, tokenizer_path: str) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.template_sandbox", tokenizer_path, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=_child_env(), limit=_REPLY_LIMIT_BYTES,
            start_new_session=True)  # a terminal's Ctrl-C reaches the router, which then stops its children
        worker = cls(process)
        try:
            line = await asyncio.wait_for(process.stdout.readline(), STARTUP_TIMEOUT_S)  # type: ignore[union-attr]
            if not line or json.loads(line).get("ready") is not True:
                raise RuntimeError(f"the chat template renderer did not start (exit code {process.returncode})")
        except BaseException:
            worker.kill()
            raise
        return worker

    async def render(self, request: bytes, timeout_s: float) -> dict[str, Any]:
        """The child's reply to one request line; TimeoutError past `timeout_s`, EOFError if the child died."""
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        async with asyncio.timeout(timeout_s):
            stdin.write(request)
            await stdin.drain()
            line = await stdout.readline()
        if not line:
            raise EOFError
        return json.loads(line)

    def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()


class _Slot:
    """A place for one child: its worker, started on demand and again after each kill."""

    def __init__(self, tokenizer_path: str, reaper: set[asyncio.Task[Any]]) -> None:
        self._tokenizer_path = tokenizer_path
        self._reaper = reaper
        self._starting: asyncio.Task[_Worker] | None = None

    async def worker(self) -> _Worker:
        if self._starting is None:
            self._starting = asyncio.create_task(_Worker.start(self._tokenizer_path))
        try:
            return await asyncio.shield(self._starting)  # a caller who leaves does not stop the start
        except Exception:
            self._starting = None  # the next caller tries again
            raise

    def replace(self) -> None:
        """Kill the worker (its state is unknown) and start the next one now, so the next request finds it ready.
        Synchronous: it runs in cancelled handlers too."""
        old = self._starting
        self._starting = asyncio.create_task(_Worker.start(self._tokenizer_path))
        if old is not None:
            task = asyncio.create_task(_reap(old))
            self._reaper.add(task)
            task.add_done_callback(self._reaper.discard)

    def close(self) -> None:
        if self._starting is not None:
            if self._starting.done() and not self._starting.cancelled() and self._starting.exception() is None:
                self._starting.result().kill()
            self._starting.cancel()


async def _reap(starting: asyncio.Task[_Worker]) -> None:
    with contextlib.suppress(Exception):
        worker = await starting
        worker.kill()
        await worker.process.wait()


class TemplateSandbox:
    """`size` child processes that render request-supplied chat templates (see the module docstring)."""

    def __init__(self, tokenizer_path: str, size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"--chat-template-workers must be >= 1, got {size}")
        self._tokenizer_path = tokenizer_path
        self._size = size
        self._free: asyncio.Queue[_Slot] | None = None  # made on the event loop, at the first render
        self._slots: list[_Slot] = []
        self._reaper: set[asyncio.Task[Any]] = set()

    def _queue(self) -> asyncio.Queue[_Slot]:
        if self._free is None:
            self._free = asyncio.Queue()
            self._slots = [_Slot(self._tokenizer_path, self._reaper) for _ in range(self._size)]
            for slot in self._slots:
                self._free.put_nowait(slot)
        return self._free

    async def render(self, job: dict[str, Any], timeout_s: float) -> str:
        """The rendered prompt of `job` (`apply_chat_template`'s arguments plus `max_chars`); InvalidRequest naming
        its field when the template fails, takes longer than `timeout_s`, or renders more than `max_chars`."""
        request = await asyncio.to_thread(_request_line, job, timeout_s)  # a body may be tens of MB
        free = self._queue()
        slot = await free.get()
        try:
            worker = await slot.worker()
            try:
                reply = await worker.render(request, timeout_s + KILL_GRACE_S)
            except BaseException as exc:  # past the deadline, dead, or the caller left mid-render: replace it
                worker.kill()  # now: C-level work stops at the deadline, not when a later task runs
                slot.replace()
                if isinstance(exc, TimeoutError):
                    raise InvalidRequest(f"the chat template took longer than {timeout_s:g} s to render",
                                         "chat_template") from None
                if isinstance(exc, EOFError):
                    raise InvalidRequest("the chat template crashed its renderer", "chat_template") from None
                raise
        finally:
            free.put_nowait(slot)
        if "error" in reply:
            raise InvalidRequest(reply["error"], reply.get("param") or "chat_template")
        return reply["text"]

    def close(self) -> None:
        for slot in self._slots:
            slot.close()


def _request_line(job: dict[str, Any], timeout_s: float) -> bytes:
    try:
        return (json.dumps({**job, "timeout_s": timeout_s}) + "\n").encode()  # ASCII: no raw newline inside
    except (TypeError, ValueError) as exc:  # parsed from JSON, so this should not happen
        raise InvalidRequest(f"the chat template's arguments are not plain JSON: {exc}", "messages") from exc


# ---- the child ----------------------------------------------------------------------------------------------------
def _limit_memory(headroom: int) -> None:
    """Cap the address space at what the loaded tokenizer uses plus `headroom`: a memory bomb fails here."""
    with contextlib.suppress(Exception):
        import resource

        status = Path("/proc/self/status").read_text()
        size = int(status.split("VmSize:")[1].split()[0]) * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _render(tokenizer: Any, job: dict[str, Any]) -> dict[str, Any]:
    from engine.processing.tokenizer import apply_chat_template
    from router.template_deadline import render_with_deadline

    try:
        text = render_with_deadline(
            lambda: apply_chat_template(tokenizer, job["messages"], job["add_generation_prompt"],
                                        job["chat_template"], job.get("tools"), job["continue_final_message"],
                                        job.get("template_kwargs")), job["timeout_s"])
    except InvalidRequest as exc:
        return {"error": str(exc), "param": exc.param}
    except (MemoryError, RecursionError) as exc:  # raised past apply_chat_template's own handler
        return {"error": f"chat template failed: {type(exc).__name__}", "param": "chat_template"}
    max_chars = job.get("max_chars")
    if max_chars is not None and len(text) > max_chars:
        return {"error": f"the chat template rendered {len(text)} characters, more than this model's context "
                         f"can hold ({max_chars})", "param": "messages"}
    return {"text": text}


def _serve(tokenizer_path: str) -> None:
    replies = os.fdopen(os.dup(1), "w", encoding="ascii")  # the protocol's own copy of stdout
    os.dup2(2, 1)  # anything else printed goes to stderr, not into a reply
    die_with_parent_if_asked()
    from engine.processing.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    _limit_memory(MEMORY_HEADROOM_BYTES)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin.buffer:
        try:
            reply = _render(tokenizer, json.loads(line))
        except MemoryError:
            reply = {"error": "chat template failed: MemoryError", "param": "chat_template"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
