"""LiveCodeBench's code generation (the shipped `passk_livecodebench`): its release files read
as released (private tests base64 of zlib of a pickled string, read by an unpickler that takes a
string and nothing else), its prompt showing the problem and no test, its programs judged in the
sandbox against every test with LiveCodeBench's comparisons, and pass@k over K samples end to
end through `watcher once`."""

from __future__ import annotations

import base64
import gzip
import json
import os
import pickle
import zlib
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.demo.tiny import addition_pairs, answer
from ckpt_watcher.evaluators.passk import pass_at_k
from ckpt_watcher.sandbox import Limits, Program, Sandbox
from ckpt_watcher.tasks import SHIPPED_TASKS
from ckpt_watcher.tasks.code import utils

from .conftest import base_config, write_config
from .helpers import watcher_once


def released(tests: list[dict[str, str]]) -> str:
    """LiveCodeBench's own encoding of its private tests."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def record(qid: str, public: list[dict], private: list[dict], func: str = "") -> dict[str, Any]:
    """One record of a `code_generation_lite` release file."""
    kind = "functional" if func else "stdin"
    return {
        "question_title": qid,
        "question_content": f"Problem {qid}: print the answer.",
        "platform": "leetcode" if func else "atcoder",
        "question_id": qid,
        "contest_id": "c1",
        "contest_date": "2025-01-04T00:00:00",
        "starter_code": f"class Solution:\n    def {func}(self, a: int, b: int) -> str:\n        "
        if func
        else "",
        "difficulty": "easy",
        "public_test_cases": json.dumps([t | {"testtype": kind} for t in public]),
        "private_test_cases": released([t | {"testtype": kind} for t in private]),
        "metadata": json.dumps({"func_name": func} if func else {}),
    }


def test_private_tests_are_read_as_released_and_nothing_but_a_string_is_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(utils, "MAX_TESTS_BYTES", 1 << 20)  # the cap, not a gigabyte to zip
    tests = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    assert utils.decode_tests(released(tests)) == tests
    assert utils.decode_tests(json.dumps(tests)) == tests and utils.decode_tests("") == []
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {ran}",))

    crafted = base64.b64encode(zlib.compress(pickle.dumps(Payload()))).decode()
    with pytest.raises(pickle.UnpicklingError, match="a string only"):
        utils.decode_tests(crafted)
    assert not ran.exists()
    listed = base64.b64encode(zlib.compress(pickle.dumps([1, 2]))).decode()
    with pytest.raises(pickle.UnpicklingError, match="EMPTY_LIST"):
        utils.decode_tests(listed)
    bomb = base64.b64encode(zlib.compress(b"\0" * (utils.MAX_TESTS_BYTES + 1))).decode()
    with pytest.raises(ValueError, match="larger than"):
        utils.decode_tests(bomb)
    # a memo index of 2**26 makes CPython's unpickler allocate a gigabyte: refused unread
    memo = base64.b64encode(
        zlib.compress(b"X\x01\0\0\0x" + b"r" + (2**26).to_bytes(4, "little") + b".")
    ).decode()
    with pytest.raises(pickle.UnpicklingError, match="LONG_BINPUT"):
        utils.decode_tests(memo)
    whole = zlib.compress(pickle.dumps(json.dumps(tests)))
    with pytest.raises(ValueError, match="one whole zlib stream"):
        utils.decode_tests(base64.b64encode(whole + b"more").decode())
    with pytest.raises(ValueError, match="list of"):
        utils.decode_tests(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="without question_id"):
        utils._doc(record("", [], []))


def test_the_prompt_shows_the_problem_and_never_a_test_and_the_last_fence_is_the_program() -> None:
    secret = {"input": "7 8\n", "output": "PRIVATE-ANSWER\n"}
    doc = utils._doc(record("p1", [{"input": "1 2\n", "output": "3\n"}], [secret]))
    shown = utils.prompt(doc)
    assert "Problem p1" in shown and "Read the inputs from stdin" in shown
    assert "PRIVATE-ANSWER" not in shown and "7 8" not in shown
    assert json.loads(doc["tests"])[-1] == secret and doc["call"] == ""
    # two records that share an id but not their tests never share a verdict
    other = utils._doc(record("p1", [{"input": "1 2\n", "output": "2\n"}], [secret]))
    assert doc["id"].startswith("p1#") and other["id"] != doc["id"]
    functional = utils._doc(record("p2", [{"input": "1\n2", "output": '"3"'}], [], func="add"))
    assert functional["call"] == "add" and "def add(self, a: int" in utils.prompt(functional)
    said = "<think>try\n```python\nprint(1)\n```\n</think>Here:\n```python\nprint(2)\n```\ndone"
    assert utils.extract_program(said) == "print(2)"
    assert utils.extract_program("```python\nprint(3)\n```") == "print(3)"
    assert utils.extract_program("print(4)") == "" and utils.extract_program("") == ""


FORGED = """import gc, os
fd = next(o["report_fd"] for o in gc.get_objects() if isinstance(o, dict) and "report_fd" in o)
os.write(fd, {report!r}.encode())
os._exit(0)
"""


def test_programs_are_judged_against_every_test_as_livecodebench_compares_them() -> None:
    # the wall-clock backstop well above the CPU limit, as the defaults are: a loop's second
    # of CPU took over 3 s of wall time beside the other tests on 2 cores (a flaky verdict)
    box = Sandbox(Limits(cpu_seconds=1, wall_seconds=6, memory_mb=512, tmp_mb=8))
    stdin = ({"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"})
    calls = ({"input": "[1,2,3]\n2", "output": "[3, 4, 5]"}, {"input": "[]\n1", "output": "[]"})
    cases = {
        "a + b": ("a, b = map(int, input().split())\nprint(a + b)\n", stdin, None, "passed"),
        "bytes": (
            "import sys\na, b = map(int, sys.stdin.buffer.read().split())\n"
            "sys.stdout.write(f'{a + b}\\n')\n",
            stdin, None, "passed",
        ),
        "main": (
            "def main():\n    a, b = map(int, input().split())\n    print(a + b)\n"
            "if __name__ == '__main__':\n    main()\n",
            stdin, None, "passed",
        ),
        "exit": ("print(sum(map(int, input().split())))\nexit()\n", stdin, None, "passed"),
        "decimals": ("print('3.0 1e1')\n", ({"input": "", "output": "3 10"},), None, "passed"),
        "a * b": ("a, b = map(int, input().split())\nprint(a * b)\n", stdin, None, "failed"),
        "second": ("input()\nprint(3)\n", stdin, None, "failed"),
        "loops": ("while True:\n    pass\n", stdin, None, "timeout"),
        "hoards": ("x = [0] * (10**10)\n", stdin, None, "memory"),
        "raises": ("raise KeyError('k')\n", stdin, None, "runtime_error"),
        "typo": ("print(\n", stdin, None, "syntax_error"),
        "method": (
            "class Solution:\n    def addAll(self, nums: List[int], k: int) -> List[int]:\n"
            "        return [x + k for x in nums]\n",
            calls, "addAll", "passed",
        ),
        "tuple": (
            "class Solution:\n    def addAll(self, nums, k):\n        return tuple(x + k for x in nums)\n",
            calls, "addAll", "passed",
        ),
        "function": ("def addAll(nums, k):\n    return [x + k for x in nums]\n", calls, "addAll",
                     "passed"),
        "wrong": ("class Solution:\n    def addAll(self, nums, k):\n        return nums\n", calls,
                  "addAll", "failed"),
        "missing": ("class Solution:\n    pass\n", calls, "addAll", "runtime_error"),
        # LiveCodeBench's ways: any exit ends a run, one Solution() for all tests, numbers
        # past Python's 4300 digits
        "exit 1": ("print(sum(map(int, input().split())))\nexit(1)\n", stdin, None, "passed"),
        "one solution": (
            "class Solution:\n    made = 0\n    def __init__(self):\n        Solution.made += 1\n"
            "    def addAll(self, nums, k):\n"
            "        return [x + k for x in nums] if Solution.made == 1 else None\n",
            calls, "addAll", "passed",
        ),
        "long int": ("print(int(input()) + 1)\n", ({"input": "9" * 5000, "output": "1" + "0" * 5000},),
                     None, "passed"),
        "waits": ("import queue\nqueue.Queue().get()\n", stdin, None, "timeout"),
        # a wrong program that goes for its verdict: the expected outputs are not in its
        # process, and a report it writes itself says nothing of them
        "reads": ("import gc\nprint([o for o in gc.get_objects() if isinstance(o, dict) "
                  "and 'output' in o][0]['output'])\n", stdin, None, "runtime_error"),
        "forges": (FORGED.format(report='{"status": "passed"}'), stdin, None, "runtime_error"),
        "forges ran": (
            FORGED.format(report='{"status": "ran", "outputs": [{"digest": "0"}, {"digest": "0"}]}'),
            stdin, None, "failed",
        ),
    }  # fmt: skip
    programs = [Program(src, tests=tests, call=call) for src, tests, call, _ in cases.values()]
    said = dict(zip(cases, box.run_many(programs), strict=True))
    assert {k: v.status for k, v in said.items()} == {k: c[3] for k, c in cases.items()}, said
    assert said["second"].error.startswith("test 2 of 2: printed '3\\n', expected '12'")
    assert said["second"].extra == {"tests_passed": 1}
    assert said["loops"].error == "test 1 of 2: over 1 s of CPU time"
    assert "KeyError: 'k'" in said["raises"].error and "runner" not in said["raises"].error
    assert said["wrong"].error == "test 1 of 2: returned [1, 2, 3], expected [3, 4, 5]"
    assert "defines no addAll()" in said["missing"].error
    assert said["waits"].error == "test 1 of 2: no end after 6 s of wall-clock time"


def test_a_fractional_cpu_limit_is_each_tests_and_the_processes_is_their_sum() -> None:
    box = Sandbox(Limits(cpu_seconds=0.5, wall_seconds=8, memory_mb=512, tmp_mb=8))
    spin = (
        "import time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.3:\n    pass\nprint(int(input()) * 2)\n"
    )
    tests = tuple({"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(4))
    quick, busy = box.run_many([Program("print(int(input()) * 2)\n", tests=tests),
                                Program(spin, tests=tests)])  # fmt: skip
    assert quick.status == busy.status == "passed", (quick, busy)
    assert busy.cpu_seconds >= 1.2  # 4 x 0.3 s: more than one test's limit, under their sum


# --- end to end: pass@k over K samples, through `watcher once` -------------------------------

# The tiny addition model cannot read LiveCodeBench's prompts: a copy of the shipped task asks
# it sums instead, and its reply (the sum's digits) is written into a fenced program that
# prints them after some reasoning, as a reasoning model's answer would be. The shipped
# filter then extracts and judges it against the problem's tests, all of whose outputs are
# the sum: a response passes exactly when the model added right.
LOCAL_YAML = """include: {shipped}
task: lcb_sums
dataset_kwargs:
  data_files:
    test: {data}
doc_to_text: !function sums.prompt
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: true
filter_list:
  - name: sandbox
    filter:
      - function: custom
        filter_fn: !function sums.fenced
      - function: custom
        filter_fn: !function sums.judge
      - function: take_first
"""
SUMS_PY = '''import json

from ckpt_watcher.tasks.code.utils import judge  # noqa: F401  (the shipped filter)


def prompt(doc):
    return json.loads(doc["tests"])[0]["input"].replace(" ", "+").strip() + "="


def fenced(resps, docs):
    """Each reply, the program a reasoning model would write for it."""
    return [
        [f"<think>the sum</think>\\n```python\\nprint({r.strip()!r})\\n```" for r in rs]
        for rs in resps
    ]
'''


def write_lcb_sums(folder: Path, n: int) -> list[dict[str, Any]]:
    """`lcb_sums` in `folder`: stdin problems whose public and private tests all expect the
    sum, a functional one, and one whose last private test expects another answer."""
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i, (a, b) in enumerate(addition_pairs(n, 2468)):
        want = answer(a, b)
        public = [{"input": f"{a} {b}\n", "output": f"{want}\n"}]
        private = [{"input": f"{b} {a}\n", "output": want}]
        if i == n - 1:  # a private test no program of this problem passes
            private.append({"input": f"{a} {b}\n", "output": "not-a-sum"})
        records.append(record(f"s{i}", public, private))
    (folder / "lcb_sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "sums.py").write_text(SUMS_PY)
    (folder / "lcb_sums.yaml").write_text(
        LOCAL_YAML.format(
            shipped=SHIPPED_TASKS / "code" / "passk_livecodebench.yaml",
            data=json.dumps(str(folder / "lcb_sums.jsonl")),
        )
    )
    return records


@pytest.mark.e2e
def test_livecodebench_pass_at_k_over_k_samples_from_a_local_release_file(
    tmp_path: Path, copy_checkpoint
) -> None:
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "lcb_step300")
    n, k = 10, 4
    records = write_lcb_sums(tmp_path / "tasks", n)
    entry = {
        "task": "lcb_sums",
        "samples": k,
        "pass_at": [1, 2, 4],
        "gen_kwargs": {"temperature": 1.0},
        "allow_code_execution": True,
    }
    raw = base_config(tmp_path, watch, tmp_path / "tasks", tasks=[entry], batch_size=16)
    raw["eval"]["sandbox"] = {"cpu_seconds": 2, "wall_seconds": 10}
    (line,) = watcher_once(write_config(tmp_path / "w.yaml", raw), tmp_path / "ledgers", "lcb")
    assert line["status"] == "ok", line["error"]
    with gzip.open(tmp_path / "ledgers" / "lcb" / line["samples_file"], "rt") as f:
        docs = [json.loads(x) for x in f]
    assert len(docs) == n
    correct = []
    for doc in docs:
        i = int(doc["target"].split("#")[0].removeprefix("s"))
        want = json.loads(records[i]["public_test_cases"])[0]["output"].strip()
        said = [r.strip() for r in doc["responses"]]
        assert len(said) == k and doc["extracted"]["sandbox"] == [f"print({r!r})" for r in said]
        verdicts = doc["verdicts"]["sandbox"]
        # passed exactly when the model added right, but for the problem no program passes
        expected = [s == want and i != n - 1 for s in said]
        assert [v["status"] == "passed" for v in verdicts] == expected, (doc, verdicts)
        assert doc["scores"]["pass,sandbox"] == [int(x) for x in expected]
        if i == n - 1:  # a right answer passes the public and the first private test
            fails_at = ["test 3 of 3" if s == want else "test 1 of 3" for s in said]
            assert [v["error"][:11] for v in verdicts] == fails_at, verdicts
        correct.append(sum(expected))
    assert 0 < sum(correct) < n * k  # some right, some wrong: the figures below can differ
    for j in (1, 2, 4):
        want = sum(pass_at_k(k, c, j) for c in correct) / n
        assert line["metrics"][f"pass_pass@{j},sandbox"] == pytest.approx(want)
