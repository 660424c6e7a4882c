"""What a request's attempts share across a retry or a migration: the failure that lets another worker take over,
and what the caller already got."""

from __future__ import annotations

from protos.kvflow.v1 import kvflow_pb2 as pb


class WorkerFailed(Exception):
    """A decode worker failed a request after accepting it (the request may go elsewhere)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason  # label of kvflow:router_retries / kvflow:migrations
        self.detail = detail


class Delivered:
    """What of a single-sample request the caller already got (sample 0), so a migration resumes after it and
    the final message still covers the whole completion."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[pb.TokenLogprob] = []
        self._before_attempt = (0, 0, 0)

    def start_attempt(self) -> None:
        self._before_attempt = (len(self.token_ids), len(self.text), len(self.logprobs))

    def add(self, chunk: pb.GenerateChunk) -> None:
        if chunk.index == 0:
            self.token_ids.extend(chunk.token_ids)
            self.text.append(chunk.text)
            self.logprobs.extend(chunk.logprobs)

    def complete(self, complete: pb.GenerateComplete) -> None:
        """A migrated request's last worker only knows its own text and logprobs: prepend the earlier ones."""
        _, num_text, num_logprobs = self._before_attempt
        if not (num_text or num_logprobs) or not complete.choices:
            return
        choice = complete.choices[0]
        choice.text = "".join(self.text[:num_text]) + choice.text
        earlier = self.logprobs[:num_logprobs]
        if earlier:
            own = list(choice.logprobs)
            del choice.logprobs[:]
            choice.logprobs.extend([*earlier, *own])
