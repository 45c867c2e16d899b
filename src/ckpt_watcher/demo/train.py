"""The demo trainer: teaches the tiny Llama 2-digit addition, saving `{run}_step{N}` checkpoints.

Run as `python -m ckpt_watcher.demo.train --out DIR`. It writes checkpoints in place (as most
trainers do), with the safetensors naming bug, so the watcher has real work to do.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

from ckpt_watcher.demo.tiny import DEMO_HEADS


def train(
    out: Path,
    run: str = "demo",
    steps: int = 600,
    save_every: int = 150,
    seed: int = 0,
    threads: int = 1,
    naming_bug: bool = True,
    final: bool = False,
    heads: int = DEMO_HEADS,
    tie_word_embeddings: bool = False,
    stop_after: int | None = None,
    keep_last: int | None = None,
    thinking: bool = False,
) -> list[Path]:
    """Train and save checkpoints; returns their paths in the order written. `stop_after`: end
    at that step, on the learning-rate schedule of all `steps` (a run cut short). `keep_last`:
    after each save, delete all but the newest that many checkpoints (HF `save_total_limit`,
    torchtitan `keep_latest_k`). `thinking`: the variant that thinks before it answers
    (`tiny.thought`)."""
    import torch

    from ckpt_watcher.demo.tiny import (
        answer,
        build_model,
        build_tokenizer,
        save_checkpoint,
        thought,
    )

    torch.set_num_threads(threads)
    tok = build_tokenizer(thinking)
    model = build_model(len(tok), seed=seed, heads=heads, tie_word_embeddings=tie_word_embeddings)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    # One-cycle schedule: a constant 3e-3 or 1e-2 stalls near loss 1.7 on this task.
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    pad = tok.pad_token_id
    saved = []
    model.train()
    for step in range(1, min(steps, stop_after or steps) + 1):
        prompts, answers = [], []
        for _ in range(64):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            prompts.append(f"{a}+{b}=")
            answers.append((thought(a, b) if thinking else answer(a, b)) + "\n")
        ids, labels = [], []
        for prompt, target in zip(prompts, answers, strict=True):
            p_ids = tok.encode(prompt, add_special_tokens=False)
            a_ids = tok.encode(target, add_special_tokens=False)
            ids.append(p_ids + a_ids)
            labels.append([-100] * len(p_ids) + a_ids)
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        label_t = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        mask = (input_ids != pad).long()
        loss = model(input_ids=input_ids, attention_mask=mask, labels=label_t).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % save_every == 0 or step == steps:
            name = f"{run}_final" if (final and step == steps) else f"{run}_step{step}"
            path = out / name
            model.eval()
            save_checkpoint(model, tok, path, naming_bug=naming_bug)
            model.train()
            saved.append(path)
            print(f"step {step}: loss {loss.item():.3f}, saved {path}", flush=True)
            if keep_last is not None:
                for old in saved[:-keep_last]:
                    if old.exists():
                        shutil.rmtree(old)
                        print(f"deleted {old} (keep last {keep_last})", flush=True)
    return saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True, help="folder the checkpoints go into")
    ap.add_argument("--run", default="demo")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--save-every", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-naming-bug", action="store_true")
    ap.add_argument("--final", action="store_true", help="name the last checkpoint {run}_final")
    ap.add_argument(
        "--keep-last", type=int, default=None, help="delete all but the newest N checkpoints"
    )
    ap.add_argument(
        "--thinking", action="store_true", help="write <think>working</think> before the answer"
    )
    ap.add_argument(
        "--heads",
        type=int,
        default=DEMO_HEADS,
        help="attention heads (default 16, size 8: hf backend only; 2 gives size 64 for vLLM)",
    )
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    from ckpt_watcher.evaluators.lm_eval_internals import without_sklearn_in_generation

    without_sklearn_in_generation()  # a second of scikit-learn imports the training never uses
    train(
        args.out,
        run=args.run,
        steps=args.steps,
        save_every=args.save_every,
        seed=args.seed,
        threads=args.threads,
        naming_bug=not args.no_naming_bug,
        final=args.final,
        heads=args.heads,
        keep_last=args.keep_last,
        thinking=args.thinking,
    )
    print(f"training done in {time.monotonic() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
