"""`--itl-target-ms`: an online model of step time, and the prefill tokens a step may carry to meet a target
(and, with `--ttft-target-ms`, the larger chunk that drains the queued prompts in time: the cap then yields).

A step's wall time is modelled as

    seconds ~= base + per_decode_seq * num_decode_seqs + per_prefill_token * num_prefill_tokens
               + mixed_step * (num_prefill_tokens > 0) + per_attention_pair * prefill_attention_pairs

where `prefill_attention_pairs` counts the (query, key) pairs the step's prefill chunks attend (a chunk of n
tokens after c cached ones: n * c + n * (n + 1) / 2), so that a chunk deep into a long prompt costs more than the
same chunk at its start. `mixed_step` is the fixed extra of a step that carries prefill (on CUDA, decode-only
steps replay a captured graph and mixed steps run eagerly; on CPU, more than one row leaves the GEMV path).

It is fitted by non-negative least squares over two sliding windows of observed steps: the last `window` steps
without prefill tokens and the last `window` with them. Two windows, not one, so that a long run of decode-only
steps never pushes the prefill samples (the only ones that measure prefill costs) out of the fit. Within each
window the k-th most recent sample weighs `recency ** k`, so the fit follows the batch it serves now.

The model is trusted only as far as it has seen: a budget never exceeds `growth` times the largest prefill
chunk in the window (or `floor_tokens`). A decode worker that has only seen short prompts (whose cost the fit
cannot tell from the fixed per-step part) then meets a long one with chunks of 16, 32, 64, ... tokens, each
step a sample further out, until the fitted costs bind; never with the whole prompt in one stalling step.

Invariants:
- The engine owns the clock and calls `observe` once per step; the scheduler only asks `prefill_token_budget`.
- Every coefficient is >= 0, so predictions grow with decode sequences, prefill tokens and attention pairs.
- `prefill_token_budget` is None (no cap) until the model has `min_samples` samples; afterwards it is an int in
  [floor_tokens, max(floor_tokens, growth * largest prefill seen)], so a capped prefill always progresses.
- The first `skip_first` observations (warm-up: allocator, kernel compilation) are dropped, and so is an
  observation more than `outlier_ratio` times the prediction inside the range already seen (never one further
  out: that is where the model learns), unless `max_outliers` in a row were (then the cost really changed).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class PrefillBudget(Protocol):
    """What the scheduler asks each step while `--itl-target-ms` is set."""

    def prefill_token_budget(self, num_decode_seqs: int, target_s: float, context_tokens: int = 0) -> int | None:
        ...

    def prefill_tokens_for_rate(self, num_decode_seqs: int, tokens_per_s: float, context_tokens: int,
                                max_tokens: int) -> int:
        ...


def attention_pairs(num_new: int, num_cached: int) -> int:
    """(query, key) pairs a prefill chunk of `num_new` tokens after `num_cached` ones attends (causal)."""
    return num_new * num_cached + num_new * (num_new + 1) // 2


@dataclass(frozen=True)
class StepCost:
    """The fitted coefficients, in seconds."""

    base_s: float
    per_decode_seq_s: float
    per_prefill_token_s: float
    mixed_step_s: float
    per_attention_pair_s: float = 0.0

    def predict(self, num_decode_seqs: int, num_prefill_tokens: int, prefill_attention_pairs: int = 0) -> float:
        return float(np.dot(self._coefficients(), _features(num_decode_seqs, num_prefill_tokens,
                                                            prefill_attention_pairs)))

    def _coefficients(self) -> tuple[float, ...]:
        return (self.base_s, self.per_decode_seq_s, self.per_prefill_token_s, self.mixed_step_s,
                self.per_attention_pair_s)

    def max_prefill_tokens(self, slack_s: float, context_tokens: int) -> float:
        """The largest chunk n, after `context_tokens` cached ones, whose prefill costs fit `slack_s`: the root of
        per_pair / 2 * n^2 + (per_token + per_pair * (context + 1/2)) * n = slack (inf: prefill looks free)."""
        pair = self.per_attention_pair_s
        linear = self.per_prefill_token_s + pair * (context_tokens + 0.5)
        if linear <= 0 and pair <= 0:
            return math.inf
        return 2 * slack_s / (linear + math.sqrt(linear * linear + 2 * pair * slack_s))


def _features(num_decode_seqs: int, num_prefill_tokens: int, pairs: int) -> tuple[float, ...]:
    mixed = 1.0 if num_prefill_tokens > 0 else 0.0
    return 1.0, float(num_decode_seqs), float(num_prefill_tokens), mixed, float(pairs)


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x c - y|| subject to c >= 0, exactly, for a few columns: the unconstrained solution when it is
    feasible, else the best feasible unconstrained solution over subsets of the columns (the NNLS optimum is one
    of them: the unconstrained fit on its own positive set). Columns are scaled to unit max for conditioning."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    num_cols = xs.shape[1]
    best, best_err = np.zeros(num_cols), float(y @ y)
    for size in range(num_cols, 0, -1):
        for cols in itertools.combinations(range(num_cols), size):
            sub, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if (sub < 0).any():
                continue
            coef = np.zeros(num_cols)
            coef[list(cols)] = sub
            if size == num_cols:
                return coef / scale  # feasible unconstrained optimum: the global one
            residual = xs @ coef - y
            err = float(residual @ residual)
            if err < best_err:
                best, best_err = coef, err
    return best / scale


Row = tuple[int, int, int, float]  # decode seqs, prefill tokens, attention pairs, seconds


class StepTimeModel:
    """Online fit of step seconds against the step's make-up; see the module docstring."""

    def __init__(self, *, floor_tokens: int = 16, window: int = 64, min_samples: int = 8, growth: float = 2.0,
                 recency: float = 0.85, skip_first: int = 3, outlier_ratio: float = 4.0,
                 max_outliers: int = 2) -> None:
        if (floor_tokens < 1 or window < 2 or min_samples < 1 or growth < 1.0 or not 0.0 < recency <= 1.0
                or outlier_ratio <= 1.0):
            raise ValueError("StepTimeModel needs floor_tokens >= 1, window >= 2, min_samples >= 1, growth >= 1, "
                             "recency in (0, 1] and outlier_ratio > 1")
        self.floor_tokens = floor_tokens
        self.recency = recency
        self.min_samples = min_samples
        self.growth = growth
        self.outlier_ratio = outlier_ratio
        self.max_outliers = max_outliers
        self._to_skip = skip_first
        self._outliers_in_row = 0
        self._decode_rows: deque[Row] = deque(maxlen=window)
        self._prefill_rows: deque[Row] = deque(maxlen=window)
        self._cost: StepCost | None = None
        self._stale = False

    @property
    def num_samples(self) -> int:
        return len(self._decode_rows) + len(self._prefill_rows)

    def observe(self, num_decode_seqs: int, num_prefill_tokens: int, seconds: float,
                prefill_attention_pairs: int = 0) -> bool:
        """Record one step; False when it was dropped (warm-up or outlier). Without `prefill_attention_pairs`
        the chunks are taken as fresh prompts (no cached context)."""
        if self._to_skip > 0:
            self._to_skip -= 1
            return False
        pairs = prefill_attention_pairs or attention_pairs(num_prefill_tokens, 0)
        if self._is_outlier(num_decode_seqs, num_prefill_tokens, pairs, seconds):
            self._outliers_in_row += 1
            return False
        self._outliers_in_row = 0
        rows = self._prefill_rows if num_prefill_tokens > 0 else self._decode_rows
        rows.append((num_decode_seqs, num_prefill_tokens, pairs, seconds))
        self._stale = True
        return True

    def _is_outlier(self, num_decode_seqs: int, num_prefill_tokens: int, pairs: int, seconds: float) -> bool:
        if self._outliers_in_row >= self.max_outliers:
            return False
        rows = [*self._decode_rows, *self._prefill_rows]
        inside = (num_prefill_tokens <= self.largest_prefill() and pairs <= max((r[2] for r in rows), default=-1)
                  and num_decode_seqs <= max((r[0] for r in rows), default=-1))
        cost = self.cost()
        return (inside and cost is not None
                and seconds > self.outlier_ratio * cost.predict(num_decode_seqs, num_prefill_tokens, pairs))

    def largest_prefill(self) -> int:
        """The most prefill tokens of a step in the window (0: none yet)."""
        return max((r[1] for r in self._prefill_rows), default=0)

    def cost(self) -> StepCost | None:
        """The current fit; None while there are too few samples to trust it."""
        if self.num_samples < self.min_samples:
            return None
        if self._stale or self._cost is None:
            rows = [*self._decode_rows, *self._prefill_rows]
            x = np.array([_features(d, p, pairs) for d, p, pairs, _ in rows])
            y = np.array([r[3] for r in rows])
            ages = np.concatenate([np.arange(len(w))[::-1] for w in (self._decode_rows, self._prefill_rows)])
            root_w = np.sqrt(self.recency ** ages)  # weighted least squares: scale rows by sqrt(weight)
            self._cost = StepCost(*(float(c) for c in nonnegative_lstsq(x * root_w[:, None], y * root_w)))
            self._stale = False
        return self._cost

    def predict(self, num_decode_seqs: int, num_prefill_tokens: int, prefill_attention_pairs: int = 0
                ) -> float | None:
        cost = self.cost()
        if cost is None:
            return None
        pairs = prefill_attention_pairs or attention_pairs(num_prefill_tokens, 0)
        return cost.predict(num_decode_seqs, num_prefill_tokens, pairs)

    def prefill_token_budget(self, num_decode_seqs: int, target_s: float, context_tokens: int = 0) -> int | None:
        """Prefill tokens a step with `num_decode_seqs` decodes may carry, in a chunk after `context_tokens`
        cached ones, so that its predicted time is at most `target_s`, within what the model has seen (`growth`
        x the largest prefill chunk); None (no cap) while there are too few samples, `floor_tokens` when even the
        decodes alone are predicted over the target."""
        cost = self.cost()
        if cost is None:
            return None
        slack = target_s - cost.predict(num_decode_seqs, 0) - cost.mixed_step_s
        if slack <= 0:
            return self.floor_tokens
        seen = max(self.floor_tokens, int(self.growth * self.largest_prefill()))
        fits = cost.max_prefill_tokens(slack, context_tokens)
        if fits >= seen:
            return seen  # prefill looks free, or cheap enough: as far as the model has seen
        return max(self.floor_tokens, int(fits))

    def prefill_tokens_for_rate(self, num_decode_seqs: int, tokens_per_s: float, context_tokens: int,
                                max_tokens: int) -> int:
        """The smallest chunk (after `context_tokens` cached ones) predicted to prefill at `tokens_per_s` or faster
        beside `num_decode_seqs` decodes, within what the model has seen (`growth` x the largest chunk) and
        `max_tokens`; the largest such chunk when none is fast enough; `floor_tokens` while the fit is not trusted.
        A step's fixed cost is paid per chunk, so a larger chunk prefills faster (binary search on that)."""
        cost = self.cost()
        largest = max(self.floor_tokens, min(max_tokens, int(self.growth * self.largest_prefill())))
        if cost is None or tokens_per_s <= 0:
            return self.floor_tokens

        def fast_enough(tokens: int) -> bool:
            seconds = cost.predict(num_decode_seqs, tokens, attention_pairs(tokens, context_tokens))
            return seconds <= 0 or tokens / seconds >= tokens_per_s

        if not fast_enough(largest):
            return largest
        low, high = self.floor_tokens, largest  # fast_enough(high) holds
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if fast_enough(middle) else (middle + 1, high)
        return high

    def prefill_tokens_per_s(self, num_decode_seqs: int, target_s: float | None, chunk_tokens: int,
                             backlog_tokens_per_s: float = 0.0) -> float:
        """How fast a prompt admitted now would prefill beside `num_decode_seqs` decodes, in chunks of at most
        `chunk_tokens` (fewer under `target_s` while decodes run, unless the queue needs `backlog_tokens_per_s`:
        the scheduler's cap yields to that, see `prefill_tokens_for_rate`); 0.0 while the fit is not trusted. The
        router weighs local against remote prefill with it."""
        cost = self.cost()
        if cost is None:
            return 0.0
        tokens = chunk_tokens
        if num_decode_seqs and target_s is not None:
            tokens = min(self.prefill_token_budget(num_decode_seqs, target_s) or chunk_tokens, chunk_tokens)
            if backlog_tokens_per_s > 0:
                tokens = max(tokens, self.prefill_tokens_for_rate(num_decode_seqs, backlog_tokens_per_s, 0,
                                                                  chunk_tokens))
        seconds = cost.predict(num_decode_seqs, tokens, attention_pairs(tokens, 0))
        return tokens / seconds if seconds > 0 else 0.0
