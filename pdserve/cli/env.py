"""Configuration from environment variables: `PDSERVE_<FLAG>` is the default of the flag `--<flag>` of the command
being run (`PDSERVE_REDIS_URL` -> `--redis-url`, `PDSERVE_HTTP_PORT` -> `--http-port`). Flags on the command line
win over the environment. This is the one place pdserve reads its environment, so containers configure every role
of the one image the same way (docker-compose `environment:`, a Kubernetes ConfigMap).

Values go through the flag's own argparse type and choices, so `PDSERVE_PORT=abc` fails as `--port abc` would,
naming the variable. Switches (`--no-prefix-cache`) take 1/true/yes/on or 0/false/no/off. Repeatable flags
(`--prefill HOST:PORT`, `--api-key`) and flags of several values (`bench --max-concurrency 1 4 16`) take a
comma-separated list. An empty variable counts as unset (compose's `${VAR:-}` passes empty strings through).

A variable that no command reads is reported (a typo); one that only other commands read is not, since containers
share one configuration across roles. The exception is a variable that guards a server (API keys, the internal
token, a TLS certificate): a server command that has no flag for it would serve less guarded than asked, so it
refuses to start (GUARDS).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

PREFIX = "PDSERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class EnvError(ValueError):
    """A PDSERVE_* variable holds a value its flag would not accept."""


@dataclass(frozen=True)
class EnvDefault:
    """One variable applied as a flag's default."""

    variable: str
    flag: str
    dest: str
    value: Any
    appends: bool = False  # a repeatable flag: argparse adds the command line's values to this default


def variable_for(option: str) -> str:
    """`--redis-url` -> `PDSERVE_REDIS_URL`."""
    return PREFIX + option.lstrip("-").replace("-", "_").upper()


def _long_option(action: argparse.Action) -> Optional[str]:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0] if longs and action.dest != "help" else None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public accessor for subcommands
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _convert(action: argparse.Action, variable: str, raw: str) -> Any:
    def one(text: str) -> Any:
        try:
            value = action.type(text) if action.type is not None else text
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            raise EnvError(f"{variable}={raw!r}: not a valid value for {_long_option(action)} ({e})") from None
        if action.choices is not None and value not in action.choices:
            raise EnvError(f"{variable}={raw!r}: choose from {', '.join(map(str, action.choices))}")
        return value

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise EnvError(f"{variable}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
        on = word in _TRUE
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
        return [one(part.strip()) for part in raw.split(",") if part.strip()]
    return one(raw)


def apply_env_defaults(parser: argparse.ArgumentParser, command: str,
                       environ: Mapping[str, str]) -> list[EnvDefault]:
    """Set the defaults of `command`'s flags from `environ`; returns what was applied."""
    sub = _subparsers(parser)[command]
    applied = []
    for action in sub._actions:
        option = _long_option(action)
        variable = variable_for(option) if option else None
        if variable is None or not environ.get(variable):
            continue
        value = _convert(action, variable, environ[variable])
        action.default = value
        applied.append(EnvDefault(variable, option, action.dest, value, isinstance(action, argparse._AppendAction)))
    return applied


# The PDSERVE_* names that are no flag's: diagnostic switches read where they act.
DIAGNOSTIC_VARIABLES = {
    "PDSERVE_TORCH_NORM_ROPE": "1 keeps RMSNorm and RoPE on CUDA on the torch references (kernels/norm_rope.py)",
    "PDSERVE_TRACE": "a folder: every process timestamps each request's points there (pdserve/common/trace.py)",
}


def _variables(parser: argparse.ArgumentParser) -> set[str]:
    return {variable_for(o) for o in map(_long_option, parser._actions) if o}


def known_variables(parser: argparse.ArgumentParser) -> set[str]:
    """Every PDSERVE_* name that some command's flag reads, and the diagnostic switches."""
    names = set(DIAGNOSTIC_VARIABLES)
    for sub in [parser, *_subparsers(parser).values()]:
        names |= _variables(sub)
    return names


SERVERS = ("up", "router", "prefill", "decode")
# The variables that guard a server, and the commands that must honour each when it is set. Workers take no API key:
# clients never call them (the internal token guards them), so a shared configuration may give them one.
GUARDS = {"PDSERVE_API_KEY": ("up", "router"), "PDSERVE_INTERNAL_TOKEN": SERVERS, "PDSERVE_TLS_CERT": SERVERS,
          "PDSERVE_TLS_KEY": SERVERS}


def check_guards(parser: argparse.ArgumentParser, command: str, environ: Mapping[str, str]) -> None:
    """EnvError when a guard variable is set for a server command that has no flag to honour it: it would serve
    without (`PDSERVE_TLS_CERT=... pdserve up` in plaintext, as `PDSERVE_API_KEY=... pdserve up` once served
    without a key)."""
    subs = _subparsers(parser)
    ignored = sorted(v for v, commands in GUARDS.items()
                     if command in commands and environ.get(v) and v not in _variables(subs[command]))
    if ignored:
        flags = ", ".join("--" + v[len(PREFIX):].lower().replace("_", "-") for v in ignored)
        others = [c for c in SERVERS if set(ignored) <= _variables(subs[c])]
        raise EnvError(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} set, but `pdserve {command}` "
                       f"has no {flags}: it would serve without {'it' if len(ignored) == 1 else 'them'}; unset "
                       + ("it" if len(ignored) == 1 else "them")
                       + (f", or run {', '.join(f'`pdserve {c}`' for c in others)}" if others else ""))


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
               environ: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """`parser.parse_args(argv)` with PDSERVE_* defaults for the chosen command. Raises EnvError."""
    environ = os.environ if environ is None else environ
    argv = list(sys.argv[1:] if argv is None else argv)
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known_variables(parser))
    if unknown:
        print(f"pdserve: ignoring {', '.join(unknown)}: no pdserve flag has that name", file=sys.stderr)
    # The command is the first word that is not an option (pdserve has no options before it but --help).
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in SERVERS and "-h" not in argv and "--help" not in argv:
        check_guards(parser, command, environ)
    applied = apply_env_defaults(parser, command, environ) if command in _subparsers(parser) else []
    args = parser.parse_args(argv)
    for d in applied:
        current = getattr(args, d.dest)
        # NOTE: argparse appends a repeated flag's values to a copy of its default, so a flag given on the command
        # line would add to the environment's list instead of replacing it. The default object itself is still
        # there only when the flag was not given.
        if d.appends and current is not d.value:
            setattr(args, d.dest, current[len(d.value):])
    return args


__all__ = ["PREFIX", "EnvError", "EnvDefault", "GUARDS", "variable_for", "apply_env_defaults", "known_variables",
           "check_guards", "parse_args"]
