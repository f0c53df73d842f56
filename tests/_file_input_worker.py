"""Runs file-reading cases in a process of its own (one without root's file capabilities, or one a hang can be
killed in) and prints one JSON line per case: ``{"code": exit code or null, "error": one line or null}``.

argv[1]: a JSON list of cases, each ``[kind, args]``:

* ``["het-plan", [override, ...]]`` / ``["het-train", [override, ...]]``: the CLI's ``main``, stderr captured;
* ``["hetero", {"cluster": ..., "plan": ...}]``: ``HeteroStrategy(**kwargs)``, the ConfigError's text.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def _cli(main, args: list[str]) -> dict:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    return {"code": code, "error": err.getvalue()}


def _hetero(kwargs: dict) -> dict:
    from het_strategy import HeteroStrategy
    from het_strategy.core.errors import ConfigError

    try:
        HeteroStrategy(**kwargs)
    except ConfigError as exc:
        return {"code": None, "error": str(exc)}
    return {"code": None, "error": None}


def main() -> None:
    for kind, args in json.loads(sys.argv[1]):
        if kind == "het-plan":
            from het_strategy.cli.plan_cli import main as plan_main

            result = _cli(plan_main, args)
        elif kind == "het-train":
            from het_strategy.cli.train_cli import main as train_main

            result = _cli(train_main, args)
        else:
            result = _hetero(args)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
