"""The per-request generation clamp, as a pure function (no lm-eval import).

For each generation request: max_gen_toks = min(requested, max_model_len - prompt_tokens).
A prompt too long for any generation keeps room for one token and is left-truncated (by the
backend's own truncation, which then has a valid length to cut to). This is lm-eval's
`maybe_truncate(shrink_gen_toks=True)` rule, which lm-eval does not expose.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_GEN_TOKS = 1


@dataclass
class ClampCounts:
    """How many requests were clamped, and how many of those also had their prompt cut."""

    clamped_requests: int = 0
    truncated_prompts: int = 0

    def take(self) -> tuple[int, int]:
        """Return the counts and reset them (one task's worth)."""
        out = (self.clamped_requests, self.truncated_prompts)
        self.clamped_requests = self.truncated_prompts = 0
        return out


def clamp_gen_toks(prompt_tokens: int, requested: int, max_len: int) -> tuple[int, bool, bool]:
    """(max_gen_toks to use, was it clamped, will the prompt be truncated)."""
    if max_len <= MIN_GEN_TOKS:
        raise ValueError(f"max_model_len {max_len} leaves no room to generate")
    room = max_len - prompt_tokens
    if requested <= room:
        return requested, False, False
    if room >= MIN_GEN_TOKS:
        return room, True, False
    return MIN_GEN_TOKS, True, True
