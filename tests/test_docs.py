"""The docs stay true: generated references match the code, and every relative link leads to a file."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _gen_docs():
    from conftest import script

    return script("gen_docs")


GEN = _gen_docs()


@pytest.mark.parametrize("page", sorted(GEN.PAGES), ids=lambda p: p.name)
def test_generated_reference_is_current(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another terminal width must not change the page: the generator fixes its own.
    monkeypatch.setenv("COLUMNS", "37")
    expected = GEN.PAGES[page]()
    assert page.exists(), f"{page.relative_to(ROOT)} is missing: run `python scripts/gen_docs.py`"
    assert page.read_text(encoding="utf-8") == expected, (
        f"{page.relative_to(ROOT)} is out of date: run `python scripts/gen_docs.py`")


def test_cli_reference_covers_every_visible_command() -> None:
    import click

    main = importlib.import_module("harness.cli").main
    text = GEN.CLI_PAGE.read_text(encoding="utf-8")
    ctx = click.Context(main, info_name="harness")
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        assert cmd is not None
        if cmd.hidden:
            assert f"`harness {name}`" not in text
        else:
            assert f"## `harness {name}`" in text
            assert cmd.help, f"harness {name} has no help: write its docstring"


def test_schema_reference_has_every_key() -> None:
    import dataclasses

    from harness.configschema import ExperimentConfig

    text = GEN.SCHEMA_PAGE.read_text(encoding="utf-8")
    for f in dataclasses.fields(ExperimentConfig):
        assert f"| `{f.name}` |" in text


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _links(page: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return _LINK.findall(text)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or a place in this page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_every_docs_page_is_reachable_from_the_index() -> None:
    index = DOCS / "index.md"
    linked = {(index.parent / t.split("#", 1)[0]).resolve() for t in _links(index)}
    missing = [p.relative_to(ROOT) for p in sorted(DOCS.rglob("*.md")) if p != index and p.resolve() not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


def test_readme_stays_the_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


_SYNOPSIS = re.compile(r"^\| `(harness [^`]*)`", re.M)


def test_command_synopses_write_flags_as_flags_and_name_real_options() -> None:
    # docs/commands.md wrote `[--allow-changes KEY=VALUE ...]` where --help shows a flag and positional overrides:
    # each option a synopsis names must be the command's, a flag followed by no value, an option taking one by one.
    import click

    main = importlib.import_module("harness.cli").main
    ctx = click.Context(main, info_name="harness")
    wrong = []
    for synopsis in _SYNOPSIS.findall((DOCS / "commands.md").read_text(encoding="utf-8")):
        tokens = synopsis.replace("\\|", "|").split()
        cmd = main.get_command(ctx, tokens[1])
        assert cmd is not None, f"{synopsis}: no command {tokens[1]}"
        params = cmd.get_params(click.Context(cmd, info_name=tokens[1], parent=ctx))  # the backends' options too
        options = {name: p for p in params if isinstance(p, click.Option) for name in (*p.opts, *p.secondary_opts)}
        for i, token in enumerate(tokens[2:], start=2):
            for name in token.strip("[]").split("|"):
                if not name.startswith("-"):
                    continue
                option = options.get(name)
                if option is None:
                    wrong.append(f"{synopsis}: {name} is no option of harness {tokens[1]}")
                    continue
                then = tokens[i + 1] if i + 1 < len(tokens) else "]"
                ends = token.endswith("]") or then.startswith(("[", "-", "/"))
                if option.is_flag and not ends:
                    wrong.append(f"{synopsis}: {name} is a flag, written with a value ({then})")
                elif not option.is_flag and ends and "|" not in token:
                    wrong.append(f"{synopsis}: {name} takes a value, written without one")
    assert not wrong, "\n".join(wrong)


def test_the_walkthrough_runs_commands_that_exist_with_options_they_take() -> None:
    # docs/before-you-submit.md shows real output of real commands: each `$ harness ...` line parses as the CLI would.
    import shlex

    import click

    page = DOCS / "before-you-submit.md"
    main = importlib.import_module("harness.cli").main
    ctx = click.Context(main, info_name="harness")
    lines = [line[2:] for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("$ harness ")]
    assert len(lines) >= 8, lines
    for line in lines:
        args = shlex.split(line)[1:]
        cmd = main.get_command(ctx, args[0])
        assert cmd is not None, line
        cmd.make_context(args[0], args[1:], parent=ctx)  # a wrong option or a missing argument raises
    assert "docs/before-you-submit.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_mixed_precision_guide_names_what_harness_records() -> None:

    from harness import tags

    text = (DOCS / "training-api.md").read_text(encoding="utf-8")
    section = text[text.index("## Mixed precision"):text.index("## Frameworks")]
    for name in (tags.AUTOCAST, tags.GRAD_SCALER, tags.METRIC_GRAD_SCALE, tags.METRIC_LR):
        assert f"`{name}`" in section, name
    # A skipped step is a step in every loop (runtime/steps.py ends it at scaler.step), as the guide says.
    assert "Such a step is still a step, in every loop" in section
