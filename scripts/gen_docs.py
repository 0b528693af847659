"""Write the generated reference pages: docs/reference/cli.md and docs/reference/experiment-schema.md.

Run `python scripts/gen_docs.py` after changing a command's help or the experiment schema;
`python scripts/gen_docs.py --check` exits 1 when a checked-in page is out of date (tests/test_docs.py
runs the same comparison).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
SCHEMA_PAGE = ROOT / "docs" / "reference" / "experiment-schema.md"

# Help is wrapped to the terminal width: a fixed width makes the page the same on every machine.
WIDTH = 100


def _banner(source: str) -> str:
    return (f"<!-- Generated from {source} by scripts/gen_docs.py. Do not edit by hand: "
            "run `python scripts/gen_docs.py`. -->\n\n")


# --- the CLI reference ---------------------------------------------------------------------------


def render_cli() -> str:
    """Every visible command's and subcommand's `--help`, as click renders it, in one page."""
    import click

    os.environ["COLUMNS"] = str(WIDTH)
    # Imported by name so that the page is made the same whether harness.cli is a module or a package.
    main = importlib.import_module("harness.cli").main
    out = [_banner("the click commands of `harness.cli.main`"), "# Command-line reference\n\n",
           "Every command's `--help`. The guide pages say more: see the [docs index](../index.md).\n\n"]

    def context(cmd: click.Command, name: str, parent: click.Context | None) -> click.Context:
        return click.Context(cmd, info_name=name, parent=parent, terminal_width=WIDTH,
                             max_content_width=WIDTH, **cmd.context_settings)

    def walk(cmd: click.Command, name: str, parent: click.Context | None, path: list[str]) -> None:
        ctx = context(cmd, name, parent)
        title = " ".join(path)
        out.append(f"{'#' * min(len(path) + 1, 4)} `{title}`\n\n```text\n{cmd.get_help(ctx).rstrip()}\n```\n\n")
        if isinstance(cmd, click.Group):
            for sub_name in cmd.list_commands(ctx):  # in the order `harness --help` lists them
                sub = cmd.get_command(ctx, sub_name)
                if sub is None or sub.hidden:
                    continue
                walk(sub, sub_name, ctx, path + [sub_name])

    walk(main, "harness", None, ["harness"])
    return "".join(out).rstrip("\n") + "\n"


# --- the experiment schema reference -------------------------------------------------------------


def _field_docs(cls: type) -> dict[str, str]:
    """A dataclass's per-field docs: the string literal written under each field (absent at runtime)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:] + [None]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _member_comments(cls: type[enum.Enum]) -> dict[str, str]:
    """An enum's members and the `# comment` on each member's line, if any."""
    lines, _ = inspect.getsourcelines(cls)
    comments: dict[str, str] = {}
    for line in lines:
        name, sep, rest = line.strip().partition("=")
        if sep and name.strip() in cls.__members__ and "#" in rest:
            comments[name.strip()] = rest.split("#", 1)[1].strip()
    return comments


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # Optional[X] and X | None alike
        rest = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in rest) + " or null"
    if origin in (list, typing.List):
        return f"list of {_type_name(args[0])}"
    if origin in (dict, typing.Dict):
        if args[1] is Any:
            return f"mapping of {_type_name(args[0])} to any value"
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(m.value for m in tp)
    if dataclasses.is_dataclass(tp):
        return f"section ({tp.__name__})"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field[Any]) -> str:
    from omegaconf import MISSING

    if f.default is MISSING:
        return "required"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if dataclasses.is_dataclass(value):
        return "its section, below"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict):
        return "`{}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_schema() -> str:
    """Every section of the experiment schema (harness/configschema.py): key, type, default and doc."""
    config = importlib.import_module("harness.configschema")
    executors = importlib.import_module("harness.executors")
    root = executors.schema().cls  # ExperimentConfig with every registered backend's section after `executor`
    # The schema's own fields are documented in ExperimentConfig; a backend's section by the backend.
    backend_docs = {name: f"The {name} backend's settings ({b.help}); declared in `{b.executor.__module__}`."
                    for name, b in executors.backends().items() if b.section is not None}
    out = [_banner("the dataclasses of `harness/configschema.py` and the backends' sections (`harness/executors`)"),
           "# experiment.yaml reference\n\n",
           "Every key of `experiment.yaml`, with its type and default. Any key can also be set on the command\n"
           "line as `KEY=VALUE` (`train.lr=0.05`). The guide is [The experiment format](../experiment-format.md).\n\n"]
    enums: dict[type, None] = {}

    def section(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        docs = {**_field_docs(config.ExperimentConfig), **backend_docs} if cls is root else _field_docs(cls)
        title = f"`{prefix}`" if prefix else "top level"
        out.append(f"## {title} ({cls.__name__})\n\n")
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            out.append(inspect.cleandoc(cls.__doc__) + "\n\n")
        out.append("| key | type | default | what it is |\n| --- | --- | --- | --- |\n")
        nested: list[tuple[type, str]] = []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}.{f.name}" if prefix else f.name
            kind, default = _type_name(tp), _default(f)
            if cls is root and f.name == "executor":  # a name from the registry, not an enum: its names as of now
                kind, default = " \\| ".join(executors.backends()), f"`{f.default}`"
            out.append(f"| `{key}` | {kind} | {default} | {_cell(docs.get(f.name, ''))} |\n")
            if dataclasses.is_dataclass(tp):
                nested.append((tp, key))
            for arg in (tp, *typing.get_args(tp)):
                if isinstance(arg, type) and issubclass(arg, enum.Enum):
                    enums[arg] = None
                if dataclasses.is_dataclass(arg) and arg is not tp:
                    nested.append((arg, f"{key}.<name>"))
        out.append("\n")
        for sub, key in nested:
            section(sub, key)

    section(root, "")
    for cls in enums:
        comments = _member_comments(cls)
        if not comments:
            continue
        out.append(f"## {cls.__name__} values\n\n")
        if cls.__doc__ and cls.__doc__ != enum.Enum.__doc__:
            out.append(inspect.cleandoc(cls.__doc__) + "\n\n")
        out.append("| value | meaning |\n| --- | --- |\n")
        for member in cls:
            out.append(f"| `{member.value}` | {_cell(comments.get(member.name, ''))} |\n")
        out.append("\n")
    return "".join(out).rstrip("\n") + "\n"


PAGES: dict[Path, Callable[[], str]] = {CLI_PAGE: render_cli, SCHEMA_PAGE: render_schema}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, render in PAGES.items():
        text = render()
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path.relative_to(ROOT))
    for path in stale:
        print(f"{path.relative_to(ROOT)} is out of date: run `python scripts/gen_docs.py`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
