"""`--itl-target-ms`: an online model of step time, and the prefill tokens a step may carry to meet a target.

A step's wall time is modelled as

    seconds ~= base + per_decode_seq * num_decode_seqs + per_prefill_token * num_prefill_tokens
               + mixed_step * (num_prefill_tokens > 0)

fitted by non-negative least squares over two sliding windows of observed steps: the last `window` steps without
prefill tokens and the last `window` with them. Two windows, not one, so that a long run of decode-only steps never
pushes the prefill samples (the only ones that measure `per_prefill_token`) out of the fit. `mixed_step` is the
fixed extra of a step that carries prefill: on CUDA, decode-only steps replay a captured graph and mixed steps run
eagerly.

Invariants:
- The engine owns the clock and calls `observe` once per step; the scheduler only asks `prefill_token_budget`.
- Every coefficient is >= 0, so predictions grow with both decode sequences and prefill tokens.
- `prefill_token_budget` is None (no cap) until the model has `min_samples` samples, `min_prefill_samples` of
  them with prefill tokens; afterwards it is never below `floor_tokens`, so a capped prefill still progresses.
- The first `skip_first` observations (warm-up: allocator, kernel compilation) are dropped, and so is an
  observation more than `outlier_ratio` times the prediction, unless `max_outliers` in a row were (then the
  cost really changed and the window follows it).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

MAX_BUDGET_TOKENS = 1 << 30  # "prefill is free" guard: a budget this large means no cap


class PrefillBudget(Protocol):
    """What the scheduler asks each step while `--itl-target-ms` is set."""

    def prefill_token_budget(self, num_decode_seqs: int, target_s: float) -> int | None: ...


@dataclass(frozen=True)
class StepCost:
    """The fitted coefficients, in seconds."""

    base_s: float
    per_decode_seq_s: float
    per_prefill_token_s: float
    mixed_step_s: float

    def predict(self, num_decode_seqs: int, num_prefill_tokens: int) -> float:
        mixed = self.mixed_step_s if num_prefill_tokens > 0 else 0.0
        return (self.base_s + self.per_decode_seq_s * num_decode_seqs
                + self.per_prefill_token_s * num_prefill_tokens + mixed)


def _features(num_decode_seqs: int, num_prefill_tokens: int) -> tuple[float, float, float, float]:
    return 1.0, float(num_decode_seqs), float(num_prefill_tokens), 1.0 if num_prefill_tokens > 0 else 0.0


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


class StepTimeModel:
    """Online fit of step seconds against (decode sequences, prefill tokens); see the module docstring."""

    def __init__(self, *, floor_tokens: int = 16, window: int = 64, min_samples: int = 8,
                 min_prefill_samples: int = 3, skip_first: int = 3, outlier_ratio: float = 4.0,
                 max_outliers: int = 2) -> None:
        if floor_tokens < 1 or window < 2 or min_samples < 1 or outlier_ratio <= 1.0:
            raise ValueError("StepTimeModel needs floor_tokens >= 1, window >= 2, min_samples >= 1 and "
                             "outlier_ratio > 1")
        self.floor_tokens = floor_tokens
        self.min_samples = min_samples
        self.min_prefill_samples = min_prefill_samples
        self.outlier_ratio = outlier_ratio
        self.max_outliers = max_outliers
        self._to_skip = skip_first
        self._outliers_in_row = 0
        self._decode_rows: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._prefill_rows: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._cost: StepCost | None = None
        self._stale = False

    @property
    def num_samples(self) -> int:
        return len(self._decode_rows) + len(self._prefill_rows)

    def observe(self, num_decode_seqs: int, num_prefill_tokens: int, seconds: float) -> bool:
        """Record one step; False when it was dropped (warm-up or outlier)."""
        if self._to_skip > 0:
            self._to_skip -= 1
            return False
        if self._is_outlier(num_decode_seqs, num_prefill_tokens, seconds):
            self._outliers_in_row += 1
            return False
        self._outliers_in_row = 0
        rows = self._prefill_rows if num_prefill_tokens > 0 else self._decode_rows
        rows.append((num_decode_seqs, num_prefill_tokens, seconds))
        self._stale = True
        return True

    def _is_outlier(self, num_decode_seqs: int, num_prefill_tokens: int, seconds: float) -> bool:
        if self._outliers_in_row >= self.max_outliers:
            return False
        cost = self.cost()
        return cost is not None and seconds > self.outlier_ratio * cost.predict(num_decode_seqs, num_prefill_tokens)

    def cost(self) -> StepCost | None:
        """The current fit; None while there are too few samples to trust it."""
        if len(self._prefill_rows) < self.min_prefill_samples or self.num_samples < self.min_samples:
            return None
        if self._stale or self._cost is None:
            rows = [*self._decode_rows, *self._prefill_rows]
            x = np.array([_features(d, p) for d, p, _ in rows])
            y = np.array([s for _, _, s in rows])
            self._cost = StepCost(*(float(c) for c in nonnegative_lstsq(x, y)))
            self._stale = False
        return self._cost

    def predict(self, num_decode_seqs: int, num_prefill_tokens: int) -> float | None:
        cost = self.cost()
        return None if cost is None else cost.predict(num_decode_seqs, num_prefill_tokens)

    def prefill_token_budget(self, num_decode_seqs: int, target_s: float) -> int | None:
        """Prefill tokens a step with `num_decode_seqs` decodes may carry so that its predicted time is at most
        `target_s`: None (no cap) while the fit is not trusted or prefill tokens look free, `floor_tokens` when
        even the decodes alone are predicted over the target."""
        cost = self.cost()
        if cost is None:
            return None
        slack = target_s - cost.predict(num_decode_seqs, 0) - cost.mixed_step_s
        if slack <= 0:
            return self.floor_tokens
        if cost.per_prefill_token_s <= 0 or slack / cost.per_prefill_token_s >= MAX_BUDGET_TOKENS:
            return None
        return max(self.floor_tokens, int(slack / cost.per_prefill_token_s))

    def prefill_tokens_per_s(self, num_decode_seqs: int, target_s: float | None, chunk_tokens: int) -> float:
        """How fast a prompt admitted now would prefill beside `num_decode_seqs` decodes, in chunks of at most
        `chunk_tokens` (fewer under `target_s` while decodes run); 0.0 while the fit is not trusted. The router
        weighs local against remote prefill with it."""
        cost = self.cost()
        if cost is None or cost.per_prefill_token_s <= 0:
            return 0.0
        tokens = chunk_tokens
        if num_decode_seqs and target_s is not None:
            tokens = min(self.prefill_token_budget(num_decode_seqs, target_s) or chunk_tokens, chunk_tokens)
        return tokens / max(cost.predict(num_decode_seqs, tokens), 1e-6)
