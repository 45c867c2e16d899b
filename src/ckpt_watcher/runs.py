"""Which run a command means: `RUN` is a run path (`jobA/mix`) or, where only one run path
ends in it, a run name (`mix`); where several runs are compared, also a pattern (`lr3e-4_seed*`)."""

from __future__ import annotations

from fnmatch import fnmatchcase

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


GLOB_CHARS = frozenset("*?[")


def is_pattern(name: str) -> bool:
    return any(c in GLOB_CHARS for c in name)


def resolve_runs(cfg: WatcherConfig, name: str) -> list[str]:
    """The run paths a RUN argument of a comparison means: one run (`resolve_run`), or for a
    shell-style pattern (`sweep/lr3e-4_seed*`, `*seed?`) every known run whose path or name
    matches it, sorted. A pattern that matches nothing: WatcherError naming the runs there are."""
    if not is_pattern(name):
        return [resolve_run(cfg, name)]
    runs = known_runs(cfg)
    pattern = name.strip("/")
    found = [
        r for r in runs if fnmatchcase(r, pattern) or fnmatchcase(r.rsplit("/", 1)[-1], pattern)
    ]
    if not found:
        raise WatcherError(f"no run matches {name!r}; runs: {', '.join(runs) or 'none'}")
    return found
