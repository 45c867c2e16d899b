"""LiveCodeBench's code generation as an lm-eval task, judged in the watcher's sandbox.

Its records (the `code_generation_lite` release files: `question_content`, `starter_code`,
`public_test_cases` as JSON, `private_test_cases` as JSON or, as released, base64 of zlib of a
pickled JSON string, `metadata` with the function's name) become documents with every test in
one list (`normalize_docs`); the private tests are read by an unpickler that accepts a string
and nothing else, so a crafted file cannot run code in the worker. The prompt is
LiveCodeBench's generic one (`prompt`): the problem, and only the problem; no test is ever
shown to the model beyond what its statement says. A response's program is its last fenced
block after any reasoning (`extract_program`, LiveCodeBench's rule); every response's program of
a batch is judged at once in the sandbox (`judge`, the task's filter), each against all of its
problem's tests (sandbox/runner.py runs each with the limits on its own and never sees the
expected outputs; sandbox/judge.py compares), and a response scores 1 when its program passes
them all (`process_results`).
Run with `samples: K` and `pass_at` for pass@k (evaluators/passk.py).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import pickle
import zlib
from typing import Any

from ckpt_watcher.evaluators.code_eval import JUDGE
from ckpt_watcher.sandbox import Program, Verdict

SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) "
    "and will generate a correct Python program that matches the specification and passes all "
    "tests."
)
WITH_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose "
    "your code within delimiters."
)
WITHOUT_STARTER = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not "
    "directly test on the sample inputs). Enclose your code within delimiters as follows. "
    "Ensure that when the python program runs, it reads the inputs, runs the algorithm and "
    "writes output to STDOUT."
)
THINK_END = "</think>"
MAX_TESTS_BYTES = 1 << 30  # decompressed tests of one problem (a zip bomb stops here)
NO_PROGRAM = Verdict("failed", "no fenced code block in the response")


# A pickled string is these opcodes and no other: a global, a call, a memo index or a
# container that could make the unpickler allocate at will is refused before loading
STRING_OPCODES = frozenset(
    {"PROTO", "FRAME", "STOP", "MEMOIZE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
     "UNICODE", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BINPUT", "LONG_BINPUT", "PUT"}
)  # fmt: skip


class _StringOnly(pickle.Unpickler):
    """Private tests are a pickled JSON string: any global (a class, a function) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"private tests may hold a string only, not {module}.{name}")


def _load_string(raw: bytes) -> Any:
    import pickletools

    for op, arg, _ in pickletools.genops(raw):
        if op.name not in STRING_OPCODES or (op.name.endswith("PUT") and arg not in (0, "0")):
            raise pickle.UnpicklingError(
                f"private tests may hold a string only, not pickle's {op.name}"
            )
    return _StringOnly(io.BytesIO(raw)).load()


def decode_tests(field: Any) -> list[dict[str, Any]]:
    """A test-case field as released: a JSON list, or base64(zlib(pickle(JSON string)))."""
    if isinstance(field, list):
        return _test_list(field)
    text = str(field or "").strip()
    if not text:
        return []
    if text.startswith("["):
        return _test_list(json.loads(text))
    inflate = zlib.decompressobj()
    raw = inflate.decompress(base64.b64decode(text, validate=True), MAX_TESTS_BYTES)
    if inflate.unconsumed_tail:
        raise ValueError(f"private tests larger than {MAX_TESTS_BYTES >> 20} MiB")
    if not inflate.eof or inflate.unused_data:
        raise ValueError("private tests: not one whole zlib stream")
    value = _load_string(raw)
    if not isinstance(value, str | bytes):
        raise ValueError(f"private tests hold {type(value).__name__}, not a JSON string")
    return _test_list(json.loads(value))


def _test_list(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and "input" in t and "output" in t for t in value
    ):
        raise ValueError("tests must be a list of {input, output} objects")
    return value


def _doc(record: dict[str, Any]) -> dict[str, Any]:
    public = decode_tests(record.get("public_test_cases"))
    private = decode_tests(record.get("private_test_cases"))
    meta = record.get("metadata") or {}
    if isinstance(meta, str):
        meta = json.loads(meta or "{}")
    tests = [{"input": str(t["input"]), "output": str(t["output"])} for t in public + private]
    functional = any(t.get("testtype") == "functional" for t in public + private)
    qid = record.get("question_id") or record.get("id")
    if not qid:
        raise ValueError("a LiveCodeBench record without question_id")
    call = str(meta.get("func_name") or "") if functional else ""
    # a program's verdict is kept under its problem's id and tests: two records that share an
    # id (converted or hand-made data) never share verdicts
    digest = hashlib.sha256(json.dumps([tests, call]).encode()).hexdigest()[:8]
    return {
        "id": f"{qid}#{digest}",
        "question": str(record["question_content"]),
        "starter_code": str(record.get("starter_code") or ""),
        "call": call,
        "tests": json.dumps(tests),
        "platform": str(record.get("platform") or ""),
        "difficulty": str(record.get("difficulty") or ""),
        "contest_date": str(record.get("contest_date") or ""),
    }


def normalize_docs(dataset: Any) -> Any:
    """Each record as a document: its problem, its starter code, its function's name (for
    functional tests), and all of its tests, public then private, as JSON."""
    return dataset.map(_doc, remove_columns=dataset.column_names)


def prompt(doc: dict[str, Any]) -> str:
    """LiveCodeBench's generic prompt, its system message first."""
    text = f"{SYSTEM}\n\n### Question:\n{doc['question']}\n\n"
    if doc["starter_code"]:
        text += f"### Format: {WITH_STARTER}\n```python\n{doc['starter_code']}\n```\n\n"
    else:
        text += f"### Format: {WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"
    return text + "### Answer: (use the provided format with backticks)\n\n"


def extract_program(response: str) -> str:
    """The code between the last two lines that hold a fence (LiveCodeBench's rule), after the
    reasoning of a thinking model; "" where there is none."""
    text = response.rsplit(THINK_END, 1)[-1]
    lines = text.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return ""
    return "\n".join(lines[fences[-2] + 1 : fences[-1]])


def judge(resps: list[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """lm-eval filter: each response's program; every one of them judged here, all at once."""
    programs = [[extract_program(r) for r in rs] for rs in resps]
    items = []
    for doc, sources in zip(docs, programs, strict=True):
        tests = tuple(json.loads(doc["tests"]))  # once per problem: they can be megabytes
        items += [(doc["id"], _program(doc, s, tests)) for s in sources if s.strip()]
    JUDGE.judge_programs(items)
    return programs


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    source = results[0]
    if not source.strip():
        JUDGE.remember(doc["id"], source, NO_PROGRAM)
        return {"pass": 0}
    verdict = JUDGE.verdicts.get((doc["id"], source))  # judged by the filter, as a rule
    if verdict is None:
        tests = tuple(json.loads(doc["tests"]))
        (verdict,) = JUDGE.judge_programs([(doc["id"], _program(doc, source, tests))])
    return {"pass": int(verdict.passed)}


def _program(doc: dict[str, Any], source: str, tests: tuple[dict[str, str], ...]) -> Program:
    return Program(source, tests=tests, call=doc["call"] or None)
