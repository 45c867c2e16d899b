"""The battery's code tasks, lm-eval's own `humaneval` and `mbpp` YAMLs (their utils, their
filters, their `code_eval` metric) over local data written here, in their datasets' formats,
for the tiny addition model: a problem's prompt ends in a sum the model answers, inside a
string that the problem's test closes, so the program is valid Python whatever the model says
and passes exactly when the model adds right. A few problems' tests end otherwise on purpose
(an endless loop, an error, a program that runs out of memory), so every verdict is seen."""

from __future__ import annotations

import json
from pathlib import Path

import lm_eval

from ckpt_watcher.demo.tiny import addition_pairs, answer

LM_EVAL_TASKS = Path(lm_eval.__file__).parent / "tasks"

# lm-eval's own task YAML (`family`: humaneval or mbpp) over a local data file
LOCAL_COPY_YAML = """include: {lm_eval}/{family}/{variant}.yaml
task: {name}
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
"""

# tests that end otherwise than by the answer, whatever the model wrote
ODD_TESTS = {
    "timeout": "while True:\n    pass\n",
    "runtime_error": "raise RuntimeError('the test itself fails')\n",
    "memory": "hoard = bytearray(64 << 30)\n",
}


def humaneval_problems(n: int, seed: int = 4321) -> list[dict]:
    """HumanEval's format: the program opens with a string holding a sum, as the model was
    trained to read it; the test closes the string, defines the entry point (which returns
    it) and checks the first answer written after the `=`: its digits, or for every third
    problem only how many there are (the tiny model's sums are right or wrong by its
    training's luck, which moves with the packages' versions; its answers' width does not, so
    every run sees programs pass)."""
    out = []
    for i, (a, b) in enumerate(addition_pairs(n, seed)):
        want = answer(a, b)
        check = f"len(said[0]) == {len(want)}" if i % 3 == 0 else f"said[0] == {want!r}"
        checked = (
            f'    said = candidate().split("=", 1)[1].split()\n    assert said and {check}, said\n'
        )
        out.append(_problem(i, f"{a}+{b}=", f"{want}", checked))
    for j, body in enumerate(ODD_TESTS.values()):
        out.append(_problem(n + j, "1+1=", "002", "    " + body.replace("\n", "\n    ")))
    return out


def _problem(i: int, sum_: str, solution: str, checked: str) -> dict:
    return {
        "task_id": f"Sums/{i}",
        "prompt": f'"""{sum_}',
        "canonical_solution": solution,
        "test": (
            f'"""\n\n\ndef sum_{i}():\n    return __doc__\n\n\ndef check(candidate):\n{checked}'
        ),
        "entry_point": f"sum_{i}",
    }


def mbpp_problems(n: int, seed: int = 8765) -> list[dict]:
    """MBPP's format; the tests pass for any program that runs (the model's digits and sums
    are Python or not: `046` is not, nor is `47+85=132`)."""
    out = []
    for i, (a, b) in enumerate(addition_pairs(n, seed)):
        last = "assert 1" if i % 4 else f"assert {a}+{b} == {a + b + 1}"  # a quarter fail
        out.append(
            {
                "task_id": 1000 + i,
                "text": f"Write {a}+{b}",
                "code": f"def f():\n    return {a + b}",
                "test_list": ["assert True", f"assert {a}+{b} == {a + b}", last],
                "test_setup_code": "",
                "challenge_test_list": [],
            }
        )
    return out


def hostile_problem(i: int, target: Path) -> dict:
    """A problem whose program goes after the host: the daemon's secrets in its environment,
    a file written into `target` (a checkpoint's folder), a process left behind."""
    body = (
        "import os, subprocess\n"
        "secret = os.environ.get('AWS_SECRET_ACCESS_KEY')\n"
        "try:\n    subprocess.Popen(['sleep', '6011'])\nexcept Exception:\n    pass\n"
        f"open({str(target / 'owned.txt')!r}, 'w').write(str(secret))\n"
    )
    return _problem(i, "1+1=", "002", "    " + body.replace("\n", "\n    "))


def write_code_tasks(folder: Path, n: int = 12, hostile: Path | None = None) -> Path:
    """`sums_humaneval`, `sums_humaneval_plus` and `sums_mbpp` in `folder` (an include_path);
    `hostile`: a folder that one more humaneval problem tries to write into."""
    folder.mkdir(parents=True, exist_ok=True)
    sums = humaneval_problems(n)
    if hostile is not None:
        sums.append(hostile_problem(len(sums), hostile))
    for family, problems in (("humaneval", sums), ("mbpp", mbpp_problems(n))):
        name = f"sums_{family}"
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(p) + "\n" for p in problems))
        # EvalPlus's HumanEval+ (lm-eval's humaneval_plus: HumanEval's fields, more tests)
        for variant in (family, f"{family}_plus") if family == "humaneval" else (family,):
            (folder / f"sums_{variant}.yaml").write_text(
                LOCAL_COPY_YAML.format(
                    lm_eval=LM_EVAL_TASKS,
                    family=family,
                    variant=variant,
                    name=f"sums_{variant}",
                    data=json.dumps(str(data)),
                )
            )
    return folder
