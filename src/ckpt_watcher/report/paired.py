"""Is a change between two steps real? A paired comparison over documents (pure).

Both steps answered the same documents, so each document is its own control: d_i is document
i's score at the later step minus the earlier one (a document's score is its mean over its K
responses). The change is the mean of d_i; its 95% interval is the paired t-interval,
mean ± t(0.975, n-1) · sd(d) / √n.

Why this test: it is deterministic (no resampling seed, the same answer every time `results`
or `samples` is run), it uses the pairing (AIME's 30 problems vary far more between
problems than between steps, which unpaired stderrs count as noise), and on per-document means
of K responses its error rate is what it says: `bench/paired.py` measures the false alarm rate
with no true change and the smallest drop found 80% of the time (figures in
docs/benchmarks.md). A percentile bootstrap of 30 documents is narrower than it should be
(more false alarms), and an exact sign-flip test gives no interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion around the normal's; within 1e-3 of the
    exact value for df >= 5 at p = 0.975, exact in the limit)."""
    z = NormalDist().inv_cdf(p)
    v = float(df)
    return (
        z
        + (z**3 + z) / (4 * v)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4)
    )


@dataclass(frozen=True)
class PairedDelta:
    delta: float  # mean over documents of (later - earlier)
    low: float  # its 95% interval
    high: float
    documents: int

    @property
    def real(self) -> bool:
        """The interval excludes zero: a change beyond the step-to-step noise."""
        return self.low > 0 or self.high < 0

    def text(self) -> str:
        mark = "" if self.real else ", within noise"
        return (
            f"Δ {self.delta:+.4f} [95% CI {self.low:+.4f}, {self.high:+.4f}] over "
            f"{self.documents} paired documents{mark}"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "delta": self.delta,
            "ci95": [self.low, self.high],
            "documents": self.documents,
            "real": self.real,
        }


def paired_delta(before: list[float], after: list[float], confidence: float = 0.95) -> PairedDelta:
    """The paired change from `before` to `after` (the same documents, in the same order)."""
    if len(before) != len(after) or not before:
        raise ValueError("a paired comparison needs the same documents on both sides")
    d = [b - a for a, b in zip(before, after, strict=True)]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return PairedDelta(mean, -math.inf, math.inf, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return PairedDelta(mean, mean - half, mean + half, n)
