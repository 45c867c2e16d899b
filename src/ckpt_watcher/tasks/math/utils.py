"""Hooks for the math tasks' YAMLs (lm-eval loads this file by path). The checking itself is
`ckpt_watcher.evaluators.mathcheck`; here only the datasets' field names and the prompts."""

from __future__ import annotations

from typing import Any

from ckpt_watcher.evaluators.mathcheck import equivalent, extract_answer, reference_answer

# DeepScaleR's instruction after each problem (rllm's math prompt)
STEP_BY_STEP = "Let's think step by step and output the final answer within \\boxed{}."

_PROBLEM_FIELDS = ("problem", "question", "Problem", "Question")
_ANSWER_FIELDS = ("answer", "final_answer", "Answer", "solution", "Solution")


def _first(doc: dict[str, Any], fields: tuple[str, ...], what: str) -> Any:
    for f in fields:
        if doc.get(f) not in (None, "", []):
            return doc[f]
    raise KeyError(f"a document has no {what} field (one of {', '.join(fields)}): {sorted(doc)}")


def normalize_docs(dataset: Any) -> Any:
    """Every math set as `problem` and `answer` (a string; a solution's boxed answer, a list
    of answers joined), whatever its own field names."""

    def one(doc: dict[str, Any]) -> dict[str, Any]:
        return {
            "problem": str(_first(doc, _PROBLEM_FIELDS, "problem")),
            "answer": reference_answer(_first(doc, _ANSWER_FIELDS, "answer")),
        }

    return dataset.map(one)


def step_by_step_prompt(doc: dict[str, Any]) -> str:
    return f"{doc['problem']} {STEP_BY_STEP}"


def extract_answers(resps: list[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """lm-eval filter: each response's final answer ("" where it gave none)."""
    return [[extract_answer(r) or "" for r in rs] for rs in resps]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    return {"math_verify": int(equivalent(results[0], doc["answer"]))}


def qwen_fewshot() -> list[dict[str, str]]:
    """math_qwen's 4 chain-of-thought exemplars (MATH training problems), each ending in
    `\\boxed{}`."""
    return [
        {
            "problem": "Find the domain of the expression $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.",
            "solution": "The numerator needs $x-2 \\ge 0$, so $x \\ge 2$. The denominator "
            "needs $5-x > 0$ (non-negative under the root and not zero), so $x < 5$. "
            "The domain is $\\boxed{[2,5)}$.",
        },
        {
            "problem": "If $\\det \\mathbf{A} = 2$ and $\\det \\mathbf{B} = 12,$ then find "
            "$\\det (\\mathbf{A} \\mathbf{B}).$",
            "solution": "The determinant of a product is the product of the determinants: "
            "$\\det (\\mathbf{A} \\mathbf{B}) = 2 \\cdot 12 = \\boxed{24}$.",
        },
        {
            "problem": "Terrell usually lifts two 20-pound weights 12 times. If he uses two "
            "15-pound weights instead, how many times must Terrell lift them in order to "
            "lift the same total weight?",
            "solution": "With the 20-pound weights he lifts $2 \\cdot 12 \\cdot 20 = 480$ "
            "pounds. With the 15-pound weights he lifts $2 \\cdot 15 \\cdot n = 30n$ pounds "
            "in $n$ lifts, and $30n = 480$ gives $n = \\boxed{16}$.",
        },
        {
            "problem": "If the system of equations\n\\begin{align*}\n6x-4y&=a,\\\\\n6y-9x &=b.\n"
            "\\end{align*}has a solution $(x, y)$ where $x$ and $y$ are both nonzero, find "
            "$\\frac{a}{b},$ assuming $b$ is nonzero.",
            "solution": "Multiplying the first equation by $-\\frac{3}{2}$ gives "
            "$6y-9x=-\\frac{3}{2}a$, which must equal $b$. So "
            "$\\frac{a}{b}=\\boxed{-\\frac{2}{3}}$.",
        },
    ]
