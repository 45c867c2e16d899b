"""What the per-document records (`samples_*.jsonl.gz`) cost on disk, per document and per
response, for records shaped like gsm8k's: an 8-shot chain-of-thought prompt (the 8 exemplars
are the same in every prompt, about 3.9 KB, plus a question of about 250 characters), a
response of about 600 characters, two filters (strict-match, flexible-extract).

No model runs: the records are written by the worker's own `write_samples`. The questions and
responses are drawn from a fixed vocabulary of words with a seeded generator, which compresses
worse than real English, so the figures are an upper bound. Usage: python bench/samples_size.py
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from ckpt_watcher.evaluators.harness import write_samples

WORDS = (
    "the of and to a in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if so "
    "no what up out about into than them can only other new some could time these two may then "
    "do first any my now such like our over man me even most made after also did many before "
    "must through back years where much your way well down should because each just those "
    "eggs apples dollars hours miles cookies students books pages minutes tickets boxes"
).split()


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(WORDS) if rng.random() > 0.15 else str(rng.randint(1, 999)))
    return " ".join(out)


def records(n_docs: int, k: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    shots = "\n\n".join(f"Question: {text(rng, 250)}\nAnswer: {text(rng, 230)}" for _ in range(8))
    out = []
    for d in range(n_docs):
        responses = [text(rng, 600) + f" The answer is {rng.randint(1, 999)}." for _ in range(k)]
        answers = [r.rsplit(" ", 1)[-1].rstrip(".") for r in responses]
        target = str(rng.randint(1, 999))
        out.append(
            {
                "task": "gsm8k_cot",
                "doc_id": d,
                "prompt": f"{shots}\n\nQuestion: {text(rng, 250)}\nAnswer:",
                "target": f"{text(rng, 200)} #### {target}",
                "responses": responses,
                "extracted": {"strict-match": answers, "flexible-extract": answers},
                "scores": {
                    "exact_match,strict-match": [float(a == target) for a in answers],
                    "exact_match,flexible-extract": [float(a == target) for a in answers],
                },
            }
        )
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for k in (1, 16):
            recs = records(1319, k)
            path = Path(tmp) / f"samples_k{k}.jsonl.gz"
            write_samples(path, recs)
            raw = sum(len(str(r)) for r in recs)
            size = path.stat().st_size
            print(
                f"gsm8k-shaped, 1319 documents x {k} response(s): {size / 1e6:.2f} MB gzipped "
                f"({raw / 1e6:.1f} MB as text); {size / 1319:.0f} bytes per document, "
                f"{size / (1319 * k):.0f} bytes per response"
            )


if __name__ == "__main__":
    main()
