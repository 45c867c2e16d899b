"""Math answer checking for the shipped math tasks (`ckpt_watcher/tasks/math`): the final
answer is taken from a response's last `\\boxed{...}` (else from "The answer is X"), and
compared with the reference by symbolic equivalence (math-verify), so `\\frac{1}{2}`, `0.5`
and `1/2` agree and `x^2+1` equals `1+x^2`.

Runs inside the worker (lm-eval calls it through the tasks' `utils.py`); math-verify is a
worker dependency (`lm-eval[math]`), imported on first use.
"""

from __future__ import annotations

import re
import threading
from typing import Any

# "The answer is 12." / "the final answer is $\frac{1}{2}$" (the Minerva / Qwen phrasing)
_ANSWER_IS = re.compile(r"answer is[:\s]*(.+?)\s*(?:\.\s*$|\.\s+|\n|$)", re.IGNORECASE)
# math-verify's own limit, per parse and per comparison, where it can use signals
TIMEOUT_SECONDS = 5


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    head = text[start:i].strip()
    if head not in ("\\boxed", "\\fbox"):  # "\boxed 5" (no braces)
        m = re.match(r"\\boxed\s+([^\s$]+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # cut off before its closing brace


def extract_answer(response: str) -> str | None:
    """A response's final answer: the last boxed one, else the last "The answer is X"."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    found = _ANSWER_IS.findall(response)
    if not found:
        return None
    answer = found[-1].strip().strip("$").strip()
    return answer or None


def reference_answer(value: Any) -> str:
    """A dataset's answer field as one string: a solution's boxed answer where it has one;
    a list of answers (OlympiadBench's `final_answer`) joined with commas."""
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    text = str(value)
    return last_boxed(text) or text


def _as_math(text: str) -> str:
    text = text.strip()
    return text if text.startswith("$") or "\\boxed" in text else f"${text}$"


def equivalent(answer: str | None, reference: str) -> bool:
    """Whether an extracted answer equals the reference, symbolically (math-verify)."""
    if answer is None or not answer.strip():
        return False
    if answer.strip() == reference.strip():
        return True
    from math_verify import parse, verify  # the worker's dependency (lm-eval[math])

    # math-verify bounds its work with SIGALRM, which only the main thread may use
    limit = TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(_as_math(reference), parsing_timeout=limit)
        pred = parse(_as_math(answer), parsing_timeout=limit)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=limit))
    except Exception:  # an answer math-verify cannot read (or that takes too long) is wrong
        return False
