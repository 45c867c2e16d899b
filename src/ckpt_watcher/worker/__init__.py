"""The worker process: everything that runs in a child of the daemon, and nothing else.

`python -m ckpt_watcher.worker JOB_DIR` runs one job (`job.py`); `--serve HOME SETTINGS_JSON`
runs a warm worker (`serve.py`) that takes job folders one after another and keeps its engine
between them. Either way the worker talks to the daemon only through the job folder
(`ckpt_watcher.jobfolder`) and its exit code. Torch, vLLM and lm-eval are imported here (through
`evaluators/`), never in the daemon.
"""
