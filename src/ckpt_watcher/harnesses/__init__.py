"""The harnesses other than lm-eval (OLMES, verifiers, any command), run per checkpoint.

- `entries.py`: their config entries (what a user writes under `eval.tasks`);
- `interp.py`: the interpreter each runs in, its environment, and its version;
- `run.py`: one entry on one checkpoint in a worker, as a subprocess, to a `TaskOutcome`;
- `endpoint.py`: the checkpoint served on loopback (vLLM's OpenAI server) behind a proxy
  that clamps requests to the context and journals each completion, so a rerun resumes;
- `command.py`, `verifiers.py`, `olmes.py`: each harness's command line and result files.

Nothing here imports a harness: each runs in its own interpreter, often its own virtualenv.
"""
