"""How long the generations in flight still need, so a drain can say at its start how many it will cut.

A drain waits --drain-timeout for requests in flight; a generation needs about its remaining max_tokens times the
inter-token latency (ITL), and on a loaded CPU host that is long (issue 27: three 400-token streams did not finish
in 30 s on a busy 2-core host; they did in 120 s). The forecast uses each generation's own measured ITL once it
streamed two tokens, else the router's recent ITL (an exponential average of every stream's gaps), else none.
"""

from __future__ import annotations

from dataclasses import dataclass

ITL_SMOOTHING = 0.1  # weight of each new gap in the router's recent ITL


class Generation:
    """One `Router.generate` call in flight: its token budget per sample and what it streamed so far."""

    def __init__(self, budget: int, samples: int) -> None:
        self.budget = budget
        self.samples = max(samples, 1)
        self.streamed = 0  # tokens, all samples together
        self._first_at: float | None = None
        self._last_at: float | None = None

    def add(self, tokens: int, now: float) -> None:
        self.streamed += tokens
        self._first_at = now if self._first_at is None else self._first_at
        self._last_at = now

    @property
    def tokens_left(self) -> int:
        return max(self.budget - self.streamed // self.samples, 0)

    def own_itl(self) -> float | None:
        """Seconds per token of this generation (per sample: samples decode side by side), once measurable."""
        steps = self.streamed / self.samples - 1
        if steps < 1 or self._first_at is None or self._last_at is None:
            return None
        return (self._last_at - self._first_at) / steps


@dataclass(frozen=True)
class DrainForecast:
    generations: int  # in flight (other requests in flight, e.g. /tokenize, end on their own)
    cut: int  # expected to outlast the drain
    unknown: int  # no ITL measured yet, for them or for the router
    needed_s: float  # the longest expected remaining time among those with an estimate
    most_tokens_left: int

    def describe(self, timeout_s: float) -> str:
        if not self.generations:
            return "no generation in flight"
        text = (f"{self.generations} generation(s) in flight, up to {self.most_tokens_left} tokens left, expected to "
                f"need up to {self.needed_s:.0f} s at the measured inter-token latency")
        if self.unknown:
            text += f" ({self.unknown} not yet measured)"
        if self.cut:
            text += (f": {self.cut} expected to be cut at the {timeout_s:g} s deadline (finish_reason 'abort'); "
                     f"--drain-timeout {self.needed_s * 1.2:.0f} would let them finish")
        return text


class GenerationTracker:
    """The generations in flight and the router's recent ITL. One per router, on its event loop."""

    def __init__(self) -> None:
        self._running: set[Generation] = set()
        self._recent_itl: float | None = None

    def start(self, budget: int, samples: int) -> Generation:
        generation = Generation(budget, samples)
        self._running.add(generation)
        return generation

    def end(self, generation: Generation) -> None:
        self._running.discard(generation)

    def observe_itl(self, seconds_per_token: float) -> None:
        previous = self._recent_itl
        self._recent_itl = seconds_per_token if previous is None else (
            previous + ITL_SMOOTHING * (seconds_per_token - previous))

    def forecast(self, timeout_s: float) -> DrainForecast:
        needs = []
        for generation in self._running:
            itl = generation.own_itl() or self._recent_itl
            needs.append(None if itl is None else generation.tokens_left * itl)
        known = [need for need in needs if need is not None]
        return DrainForecast(generations=len(needs), cut=sum(need > timeout_s for need in known),
                             unknown=len(needs) - len(known), needed_s=max(known, default=0.0),
                             most_tokens_left=max((g.tokens_left for g in self._running), default=0))
