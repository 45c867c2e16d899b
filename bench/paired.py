"""How well the paired step comparison (`report/paired.py`) tells a real change from noise, on
synthetic per-document scores shaped like AIME: 30 problems, K responses each, problem
difficulties spread from never to always solved.

Each trial draws the two steps' responses: with no true change both steps have every problem's
own solve rate; with a drop of δ every rate is lowered by δ (floored at 0). Reported, per K:
the false alarm rate (interval excludes zero with no change; target <= 5%), and the smallest δ
the interval catches in at least 80% of trials. Beside it, for contrast, the unpaired rule the
results table's `*` uses (|Δ| > 2 · sqrt(se_a² + se_b²), stderrs over problems).

Usage: python bench/paired.py [--trials 2000] [--problems 30]
"""

from __future__ import annotations

import argparse
import math
import random

from ckpt_watcher.report.paired import paired_delta


def draw(rates: list[float], k: int, rng: random.Random) -> list[float]:
    """Each problem's mean score over k responses."""
    return [sum(rng.random() < p for _ in range(k)) / k for p in rates]


def unpaired_flag(a: list[float], b: list[float]) -> bool:
    def se(x: list[float]) -> float:
        m = sum(x) / len(x)
        return math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x))

    return abs(sum(b) / len(b) - sum(a) / len(a)) > 2 * math.sqrt(se(a) ** 2 + se(b) ** 2)


def rates_for(problems: int, rng: random.Random) -> list[float]:
    """AIME-like: a third never solved, a few always, the rest in between."""
    out = []
    for _ in range(problems):
        u = rng.random()
        out.append(0.0 if u < 0.33 else 1.0 if u > 0.9 else rng.betavariate(1.2, 1.2))
    return out


def rates_of_flags(
    k: int, drop: float, trials: int, problems: int, seed: int
) -> tuple[float, float]:
    rng = random.Random(seed)
    paired = unpaired = 0
    for _ in range(trials):
        rates = rates_for(problems, rng)
        later = [max(0.0, p - drop) for p in rates]
        a, b = draw(rates, k, rng), draw(later, k, rng)
        paired += paired_delta(a, b).real
        unpaired += unpaired_flag(a, b)
    return paired / trials, unpaired / trials


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--problems", type=int, default=30)
    args = ap.parse_args()
    print(f"{args.problems} problems, {args.trials} trials per figure")
    for k in (16, 1):
        far, far_unpaired = rates_of_flags(k, 0.0, args.trials, args.problems, seed=k)
        print(f"K={k}: false alarm rate, no change: paired {far:.3f}, unpaired {far_unpaired:.3f}")
        found = found_unpaired = None
        for step in range(1, 81):
            drop = step / 200
            power, power_unpaired = rates_of_flags(
                k, drop, args.trials // 4, args.problems, seed=step
            )
            if found is None and power >= 0.8:
                found = drop
            if found_unpaired is None and power_unpaired >= 0.8:
                found_unpaired = drop
            if found is not None and found_unpaired is not None:
                break
        print(
            f"K={k}: smallest drop flagged in >= 80% of trials: paired {found}, unpaired {found_unpaired}"
        )


if __name__ == "__main__":
    main()
