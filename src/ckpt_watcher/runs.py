"""Which run a command means: `RUN` is a run path (`jobA/mix`) or, where only one run path
ends in it, a run name (`mix`)."""

from __future__ import annotations

from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.errors import ConfigError, StateError, WatcherError
from ckpt_watcher.ledger import iter_runs
from ckpt_watcher.state import State


def known_runs(cfg: WatcherConfig) -> list[str]:
    """Every run path the daemon has seen (state) or has results for (ledgers), sorted."""
    runs = set(iter_runs(cfg.ledger_dir))
    try:
        state = State(cfg.state_dir, readonly=True)
    except StateError:
        return sorted(runs)
    try:
        runs |= {r.run_path for r in state.checkpoints() if r.run}
    finally:
        state.close()
    return sorted(runs)


def resolve_run(cfg: WatcherConfig, name: str) -> str:
    """The run path `name` means. Unknown: WatcherError (exit 1) naming the runs there are;
    a run name that several run paths share: ConfigError (exit 2) naming them."""
    runs = known_runs(cfg)
    if name.strip("/") in runs:
        return name.strip("/")
    matches = [r for r in runs if r.rsplit("/", 1)[-1] == name]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ConfigError(
            f"run name {name!r} is used by {len(matches)} runs: {', '.join(matches)}; "
            "give the run path"
        )
    raise WatcherError(
        f"no run {name!r} in the state or the ledgers; runs: {', '.join(runs) or 'none'}"
    )
