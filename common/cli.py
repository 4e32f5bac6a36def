"""Command lines: every flag also settable from the environment, and the `tandem` console script.

A flag is defined once, with argparse; env_settable() then lets TANDEM_<FLAG> (the flag's first
long name, upper-cased, dashes as underscores: --max-model-len -> TANDEM_MAX_MODEL_LEN) set its
default, and says so in --help. An explicit flag still wins over the environment.

    tandem serve MODEL_DIR [--draft DIR]   target + draft + router on loopback (router.launch)
    tandem target|draft|router ...         one of them (the same flags as python -m <service>)
    tandem batch -i IN.jsonl -o OUT.jsonl  OpenAI's Batch format through a router (router.batch)
"""

from __future__ import annotations

import argparse
import os
import sys

PREFIX = "TANDEM_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def env_name(action: argparse.Action) -> str | None:
    longs = [s for s in action.option_strings if s.startswith("--")]
    if not longs or action.dest == "help":
        return None
    return PREFIX + longs[0][2:].upper().replace("-", "_")


def env_settable(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """Defaults of every flag of `parser` from TANDEM_* variables. Bad values exit like bad flags do."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:  # argparse has no public iterator over its actions
        name = env_name(action)
        if name is None:
            continue
        if action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {name}]".strip()
        if name not in environ:
            continue
        raw = environ[name]
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            if raw.lower() not in _TRUE | _FALSE:
                parser.error(f"{name}={raw!r}: expected one of {sorted(_TRUE | _FALSE)}")
            action.default = (raw.lower() in _TRUE) == isinstance(action, argparse._StoreTrueAction)
        elif isinstance(action, argparse._AppendAction):
            action.default = [action.type(v) if action.type else v for v in raw.split(",") if v]
        elif action.nargs in ("+", "*"):  # a list flag: its values separated by spaces, as on the command line
            action.default = [action.type(v) if action.type else v for v in raw.split()]
        else:
            try:
                action.default = action.type(raw) if action.type else raw
            except (TypeError, ValueError):
                parser.error(f"{name}={raw!r}: invalid value for {action.option_strings[0]}")
            if action.choices is not None and action.default not in action.choices:
                parser.error(f"{name}={raw!r}: choose from {list(action.choices)}")
        action.required = False
    return parser


class Secret(str):
    """A flag value that is never shown: its str and repr are *** (in --help defaults, argparse
    messages, logs). The value itself is the str's contents: .encode() and comparisons see them."""

    def __new__(cls, value: str) -> Secret:
        # argparse applies the type again to a string default (an environment variable's): keep the
        # contents, not the *** its str() would give
        return super().__new__(cls, str.__str__(value) if isinstance(value, Secret) else value)

    def __repr__(self) -> str:
        return "'***'"

    def __str__(self) -> str:
        return "***"


_COMMANDS = {
    "serve": ("router.launch", "target + draft + router on loopback: tandem serve MODEL_DIR [--draft DIR]"),
    "target": ("target_service.__main__", "the target-model gRPC service"),
    "draft": ("draft_service.__main__", "the draft-model gRPC service"),
    "router": ("router.__main__", "the router: scheduler, HTTP (OpenAI) and gRPC front doors"),
    "batch": ("router.batch", "requests in OpenAI's Batch format through a router: tandem batch -i IN -o OUT"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        width = max(map(len, _COMMANDS))
        lines = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in _COMMANDS.items())
        print(f"usage: tandem COMMAND [ARGS]   (tandem COMMAND --help for its flags)\n\ncommands:\n{lines}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(_COMMANDS[argv[0]][0])
    return module.main(argv[1:], prog=f"tandem {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
