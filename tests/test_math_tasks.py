"""The shipped math tasks: answer extraction and symbolic checking (math-verify), and
`math_qwen` and a pass@k set loaded by lm-eval on local fixture files (`dataset_path: json`),
their prompts built and hand-written responses scored by the tasks' own filter and metric."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckpt_watcher.evaluators.mathcheck import equivalent, extract_answer, last_boxed
from ckpt_watcher.tasks import SHIPPED_TASKS, task_paths

MATH = SHIPPED_TASKS / "math"
PASSK_SETS = {
    "passk_aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "passk_aime25": ("MathArena/aime_2025", None, "train"),
    "passk_amc": ("opencompass/LiveMathBench", "v202412_AMC_en", "test"),
    "passk_amc25": ("opencompass/LiveMathBench", "v202505_hard_en", "test"),
    "passk_math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "passk_minerva": ("math-ai/minervamath", None, "test"),
    "passk_olympiadbench": ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
}


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("first \\boxed{3}, then \\boxed{\\sqrt{2}}", "\\sqrt{2}"),  # the last one
        ("\\boxed{\\{1, \\frac{a}{b}\\}}", "\\{1, \\frac{a}{b}\\}"),  # nested braces
        ("\\fbox{7}", "7"),
        ("The answer is 12.", "12"),
        ("so the final answer is $\\frac{3}{4}$. I hope it is correct.", "\\frac{3}{4}"),
        ("The answer is 0.5\nQuestion: next", "0.5"),
        ("\\boxed{12", None),  # cut off before the brace closed
        ("I do not know", None),
    ],
)
def test_the_final_answer_is_the_last_boxed_one_else_the_answer_is(
    response: str, answer: str | None
) -> None:
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    ("answer", "reference", "same"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "\\frac12", True),
        ("1+x^2", "x^2+1", True),
        ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
        ("-\\frac{2}{3}", "-2/3", True),
        ("1, -1", "-1, 1", True),  # a set of roots, either order
        ("033", "33", True),  # AIME's three digits
        ("[2,5)", "[2,5)", True),
        ("0.4", "0.5", False),
        ("12", "21", False),
        ("[2,5]", "[2,5)", False),
        ("", "0", False),
        (None, "0", False),
    ],
)
def test_answers_are_compared_by_symbolic_equivalence(
    answer: str | None, reference: str, same: bool
) -> None:
    assert equivalent(answer, reference) is same


def test_each_pass_at_k_set_names_its_public_dataset() -> None:
    """The seven sets of the DeepScaleR protocol, each with the dataset, subset and split
    the README lists."""
    for name, (path, subset, split) in PASSK_SETS.items():
        cfg = yaml.safe_load((MATH / f"{name}.yaml").read_text())
        assert cfg["task"] == name
        assert (cfg["dataset_path"], cfg.get("dataset_name"), cfg["test_split"]) == (
            path,
            subset,
            split,
        )
    template = (MATH / "_passk_template_yaml").read_text()
    for setting in ("temperature: 0.6", "top_p: 0.95", "max_gen_toks: 32768", "do_sample: true"):
        assert setting in template


def _fixture_task(folder: Path, base: str, name: str, docs: list[dict[str, Any]]) -> None:
    """A task that `include:`s a shipped one and reads local JSON lines instead of the Hub."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(
        yaml.safe_dump(
            {
                "include": str(MATH / f"{base}.yaml"),
                "task": name,
                "dataset_path": "json",
                "dataset_name": None,
                "test_split": "test",
                "dataset_kwargs": {"data_files": {"test": str(data)}},
            }
        )
    )


MATH_DOCS = [  # MATH's own fields: the answer is the solution's last \boxed{}
    {"problem": "Write $\\frac{1}{2}$ as a decimal.", "solution": "It is $\\boxed{0.5}$."},
    {"problem": "Simplify $(x+1)^2 - 2x$.", "solution": "$\\boxed{x^2+1}$"},
]
OLYMPIAD_DOCS = [  # OlympiadBench's fields: `final_answer` is a list
    {"question": "What is half of one?", "final_answer": ["\\frac{1}{2}"]},
    {"question": "Solve $x^2 = 1$.", "final_answer": ["-1", "1"]},
]


@pytest.fixture(scope="module")
def fixture_tasks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    from ckpt_watcher.evaluators import lm_eval_internals as lmi

    folder = tmp_path_factory.mktemp("math_fixtures")
    _fixture_task(folder, "math_qwen", "math_qwen_fixture", MATH_DOCS)
    _fixture_task(folder, "passk_olympiadbench", "olympiad_fixture", OLYMPIAD_DOCS)
    tm = TaskManager(include_path=task_paths(folder), include_defaults=False)
    assert set(PASSK_SETS) | {"math_qwen"} <= set(tm.all_tasks)  # all shipped tasks indexed
    return {n: lmi.load_task(tm, n)[0] for n in ("math_qwen_fixture", "olympiad_fixture")}


def _score(task: Any, doc: dict[str, Any], response: str) -> tuple[str, int]:
    from ckpt_watcher.evaluators import lm_eval_internals as lmi

    answer, metrics = lmi.score_response(task, doc, response)["final-answer"]
    return answer, metrics["math_verify"]


def test_math_qwen_prompt_is_question_answer_after_four_boxed_exemplars(
    fixture_tasks: dict[str, Any],
) -> None:
    task = fixture_tasks["math_qwen_fixture"]
    docs = list(task.test_docs())
    assert [d["answer"] for d in docs] == ["0.5", "x^2+1"]
    prompt = task.fewshot_context(docs[0], num_fewshot=4)
    shots = prompt.split("\n\n")
    assert len(shots) == 5 and shots[-1] == f"Question: {MATH_DOCS[0]['problem']}\nAnswer:"
    for shot in shots[:4]:
        assert shot.startswith("Question: ") and "\nAnswer: " in shot
        assert last_boxed(shot) is not None and shot.rstrip(".$").endswith("}")
    # each response scored by the task's own filter and metric
    assert _score(task, docs[0], "So it is $\\boxed{\\frac{1}{2}}$.") == ("\\frac{1}{2}", 1)
    assert _score(task, docs[0], "Dividing, the answer is 1/2.") == ("1/2", 1)
    assert _score(task, docs[0], "The answer is 0.4.") == ("0.4", 0)
    assert _score(task, docs[0], "It is one half.") == ("", 0)
    assert _score(task, docs[1], "We get \\boxed{1 + x^{2}}") == ("1 + x^{2}", 1)


def test_a_pass_at_k_set_prompts_step_by_step_and_checks_list_answers(
    fixture_tasks: dict[str, Any],
) -> None:
    task = fixture_tasks["olympiad_fixture"]
    docs = list(task.test_docs())
    assert [d["answer"] for d in docs] == ["\\frac{1}{2}", "-1, 1"]
    assert task.doc_to_text(docs[0]) == (
        "What is half of one? Let's think step by step and output the final answer "
        "within \\boxed{}."
    )
    gen = task.config.generation_kwargs
    assert (gen["temperature"], gen["top_p"], gen["max_gen_toks"]) == (0.6, 0.95, 32768)
    assert _score(task, docs[0], "Half is \\boxed{0.5}") == ("0.5", 1)
    assert _score(task, docs[1], "x = \\pm 1, so \\boxed{1, -1}") == ("1, -1", 1)
    assert _score(task, docs[1], "\\boxed{1}") == ("1", 0)
    assert _score(task, docs[0], "The answer is 0.5") == ("0.5", 1)
