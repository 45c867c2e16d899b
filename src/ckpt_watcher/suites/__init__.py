"""Suites: named lists of task entries. `{suite: NAME}` in `eval.tasks` expands to the suite's
entries; each entry may name its `headline` metrics, the columns of
`watcher results RUN --suite NAME`. Suites ship here (one YAML per suite); `eval.suite_path`
(a YAML file or a folder of them) adds the user's own, which win on a name clash.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SHIPPED_SUITES = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    entries: list[dict[str, Any]]  # task entries, as in eval.tasks (without `headline`)
    headline: list[tuple[str, int | None, str]] = field(default_factory=list)  # (task, shots, key)
    path: Path | None = None


def _suite_files(suite_path: str | Path | None) -> list[Path]:
    files = sorted(SHIPPED_SUITES.glob("*.yaml"))
    if suite_path:
        p = Path(suite_path).expanduser()
        if p.is_dir():
            files += sorted(p.glob("*.y*ml"))
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"suite_path {str(p)!r} is neither a YAML file nor a folder")
    return files


def _parse(path: Path) -> Suite:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"suite file {path}: {str(e).splitlines()[0]}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("tasks"), list) or not raw["tasks"]:
        raise ValueError(f"suite file {path}: expected a mapping with a non-empty `tasks` list")
    entries, headline = [], []
    for i, item in enumerate(raw["tasks"]):
        if not isinstance(item, dict) or "task" not in item:
            raise ValueError(f"suite file {path}: tasks[{i}] must be a mapping with a `task` key")
        entry = {k: v for k, v in item.items() if k != "headline"}
        entries.append(entry)
        for key in item.get("headline") or []:
            label = entry.get("name") or entry["task"]  # the results column's task part
            headline.append((str(label), entry.get("num_fewshot"), str(key)))
    return Suite(
        name=str(raw.get("name") or path.stem),
        description=str(raw.get("description") or "").strip(),
        entries=entries,
        headline=headline,
        path=path,
    )


def load_suites(suite_path: str | Path | None = None) -> dict[str, Suite]:
    """Every suite by name: the shipped ones, then the user's (which replace a shipped one of
    the same name)."""
    suites: dict[str, Suite] = {}
    for f in _suite_files(suite_path):
        suite = _parse(f)
        suites[suite.name] = suite
    return suites


def get_suite(name: str, suite_path: str | Path | None = None) -> Suite:
    suites = load_suites(suite_path)
    if name not in suites:
        close = difflib.get_close_matches(name, sorted(suites), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown suite {name!r} ({hint}suites: {', '.join(sorted(suites))}; "
            "`watcher suites` lists them, eval.suite_path adds your own)"
        )
    return suites[name]


def expand(tasks: list[Any], suite_path: str | Path | None = None) -> list[Any]:
    """`eval.tasks` with each `{suite: NAME}` replaced by the suite's entries (copies)."""
    out: list[Any] = []
    for item in tasks:
        if isinstance(item, dict) and "suite" in item:
            extra = sorted(set(item) - {"suite"})
            if extra:
                raise ValueError(
                    f"a suite entry takes only `suite`, not {', '.join(extra)}: list the task "
                    "itself to change its settings, or write your own suite (eval.suite_path)"
                )
            out += [dict(e) for e in get_suite(str(item["suite"]), suite_path).entries]
        else:
            out.append(item)
    return out
