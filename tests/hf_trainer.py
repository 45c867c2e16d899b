"""The real transformers `Trainer` on the demo's tiny model, saving `checkpoint-N` folders as
every HF Trainer does (model, tokenizer, training_args.bin, optimizer, scheduler, RNG state,
trainer_state.json last).

Usage: python tests/hf_trainer.py OUT STEPS SAVE_STEPS [STEP_SECONDS]

STEP_SECONDS (default 0) is slept after every step, so saves are that far apart times
SAVE_STEPS, as a real model's slower steps make them: each save then finds a watcher idle and
quick to look, which is when a watcher that judges too early judges a half-saved folder.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ckpt_watcher.demo.tiny import addition_pairs, answer, build_model, build_tokenizer

    out, steps, save_steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    step_seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed=0)

    class Sums(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.rows = [f"{a}+{b}={answer(a, b)}" for a, b in addition_pairs(n, 0)]

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> dict[str, Any]:
            ids = tokenizer(self.rows[i])["input_ids"] + [tokenizer.eos_token_id]
            return {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}

    class Pace(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(step_seconds)

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        save_steps=save_steps,
        per_device_train_batch_size=32,
        learning_rate=3e-3,
        report_to=[],
        logging_steps=10_000,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Sums(4096),
        processing_class=tokenizer,
        callbacks=[Pace()],
    )
    trainer.train()


if __name__ == "__main__":
    main()
