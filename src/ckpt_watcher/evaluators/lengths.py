"""How long a generation task's responses were and why they stopped (pure; no lm-eval import).

Each response is measured as the engine produced it (`lm_eval_internals.StatsHook`): the tokens
it generated, in the checkpoint's tokenizer, and its finish: `length` where the generation
budget (`max_gen_toks`, or the clamp's smaller one) ran out, `stop` where EOS or a stop sequence
ended it. RL researchers watch both step by step: reasoning responses grow with training, and a
rising share that hits the cap means answers are being cut off.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# (tokens, finish, unterminated: True where thinking never closed, None without think_end)
Measure = tuple[int | None, str | None, bool | None]


def percentile(sorted_values: list[int], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between neighbours (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary(measures: Iterable[Measure]) -> dict[str, Any] | None:
    """`response_tokens` {mean, p50, p90, max}, `length_capped_rate` and `unterminated_rate`
    (None without think_end) over the responses that were measured (a response replayed from a
    journal written before measuring has none); None where no response was (a likelihood
    task)."""
    measures = list(measures)  # read twice below
    known = [(m[0], m[1]) for m in measures if m[0] is not None]
    if not known:
        return None
    judged = [m[2] for m in measures if m[2] is not None]
    tokens = sorted(t for t, _ in known)
    return {
        "response_tokens": {
            "mean": sum(tokens) / len(tokens),
            "p50": percentile(tokens, 0.5),
            "p90": percentile(tokens, 0.9),
            "max": tokens[-1],
        },
        "length_capped_rate": sum(1 for _, f in known if f == "length") / len(known),
        "unterminated_rate": sum(judged) / len(judged) if judged else None,
        "measured_responses": len(known),
    }


def attach(records: list[dict[str, Any]], measures: dict[tuple[Any, Any], list[Measure]]) -> None:
    """Give each per-document record its responses' `response_tokens` and `finish` (and
    `unterminated`, with think_end), in the order of its `responses` (where the document's
    responses were measured)."""
    for rec in records:
        found = measures.get((rec["task"], rec["doc_id"]))
        if found and len(found) == len(rec.get("responses") or []):
            rec["response_tokens"] = [m[0] for m in found]
            rec["finish"] = [m[1] for m in found]
            if any(m[2] is not None for m in found):
                rec["unterminated"] = [m[2] for m in found]
