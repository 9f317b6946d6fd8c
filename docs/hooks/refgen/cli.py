"""The CLI reference from `hptransfer.cli.build_parser()`: every command, its usage and flags."""

from __future__ import annotations

import argparse

from .schema import cell


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | choices | meaning |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        if action.nargs == "?":
            name += " (optional)"
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) else f"`{default}`"
        choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
        meaning = cell(action.help or "")
        rows.append(f"| {cell(name)} | {cell(shown)} | {cell(choices)} | {meaning} |")
    return rows


def page() -> str:
    from hptransfer.cli import build_parser

    parser = build_parser()
    commands = _subcommands(parser)
    helps = _helps(parser)
    out = ["# CLI reference", "",
           "Generated from `hptransfer.cli.build_parser()` at every docs build. "
           "`hpt COMMAND --help` prints the same.", "",
           "| command | what it does |", "|---|---|"]
    out += [f"| [`hpt {name}`](#hpt-{name}) | {cell(helps.get(name, ''))} |" for name in commands]
    out.append("")
    for name, sub in commands.items():
        usage = sub.format_usage().replace("usage: ", "", 1).strip()
        out += [f"## hpt {name} {{ #hpt-{name} }}", "", helps.get(name, ""), "",
                "```text", usage, "```", ""]
        if sub.description:
            out += [sub.description, ""]
        out += _argument_rows(sub) + [""]
    return "\n".join(out)
