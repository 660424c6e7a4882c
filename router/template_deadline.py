"""A chat template rendered under a deadline, checked between Python lines: the router's thread path for the
model's own template and, inside the child process, a request's own template (router/template_sandbox.py, which also
kills the child for C-level work the check cannot see)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from engine.errors import InvalidRequest

JINJA_FILENAME = "<template>"  # the code filename of a template compiled from a string (transformers does)


class _RenderTimeout(BaseException):
    """A BaseException, so no `except Exception` inside Jinja or transformers can swallow it mid-render."""


def render_with_deadline(render: Callable[[], str], timeout_s: float) -> str:
    """`render()` (a Jinja chat template), failed with InvalidRequest once it runs past `timeout_s`.

    A thread cannot be interrupted from outside, so the render checks the deadline itself: a trace function on
    this thread sees each function call and each line of the compiled template (plain Python) and raises once time
    is up.
    """
    deadline = time.monotonic() + timeout_s

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _RenderTimeout
        # Line events only inside template code (a loop there may call nothing); every other call is seen on entry.
        return trace if frame.f_code.co_filename == JINJA_FILENAME else None

    previous = sys.gettrace()  # a debugger's or coverage's, restored below
    sys.settrace(trace)
    try:
        return render()
    except _RenderTimeout:
        raise InvalidRequest(f"the chat template took longer than {timeout_s:g} s to render") from None
    finally:
        sys.settrace(previous)
