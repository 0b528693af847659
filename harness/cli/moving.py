"""The commands that move records: export a run to a bundle, import one. attest and verify-record, which sign and
check a record, are the attest extra's (harness/extras/attest)."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from harness.cli.console import draw, emit, expected_errors, say
from harness.cli.options import TRACKING_HELP, json_option
from harness.commands.bundleformat import DEFAULT_MAX_RATIO, DEFAULT_MAX_UNPACKED_MIB, MIB, RATIO_FLOOR


@click.command(name="export")
@click.argument("run_id")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The bundle to write (.tar.gz).")
@click.option("--with-checkpoints", is_flag=True, help="Include the run's checkpoints (left out by default: big).")
@click.option("--with-image", is_flag=True, help="Include the pinned image (docker save); import loads it.")
@click.option("--with-data", is_flag=True,
              help="Include the declared data's files, checked against their recorded sha256 (left out by default).")
@click.option("--tree-only", is_flag=True,
              help="Ship the recorded commit's files without the git history before it (a secret committed once "
                   "and deleted since leaves with the history).")
@click.option("--sign", "sign_key", type=click.Path(path_type=Path), default=None,
              help="An ed25519 private key (PEM): also write OUTPUT.intoto.json, a signed attestation of the run.")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def export_(run_id: str, output: Path, with_checkpoints: bool, with_image: bool, with_data: bool, tree_only: bool,
            sign_key: Path | None, tracking_uri: str | None, as_json: bool) -> None:
    """Write RUN_ID, its code and its replays to one portable bundle.

    The bundle holds the run's record (params, tags, every metric write with its step and timestamp,
    artifacts), a git bundle of the recorded commit, the replays of the run, and a manifest with the
    sha256 of every member. Run it inside a clone that has the recorded commit. Exit 0 written, 2 bad input
    (nothing written).
    """
    from harness.commands import api, documents

    result = api.export(api.ExportOptions(run_id, output, with_checkpoints=with_checkpoints, with_image=with_image,
                                          with_data=with_data, sign_key=sign_key, tracking_uri=tracking_uri,
                                          tree_only=tree_only, on_event=draw))
    image = f", image {result.image}" if result.image else ""
    say(f"Exported run {result.run_id} ({len(result.replays)} replays{image}): {result.members} files, "
         f"{result.size} bytes.")
    if result.signed is not None:
        say(f"Signed attestation: {result.signed}")
    if as_json:
        emit(documents.export(result, None if result.signed is None else str(result.signed)))
    click.echo(str(result.path))


@click.command(name="import")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Where the bundle's declared data goes (default ./harness-data/ORIGINAL_RUN_ID).")
@click.option("--max-unpacked-mib", "max_unpacked_mib", metavar="MIB", type=click.FloatRange(min=0, min_open=True),
              default=DEFAULT_MAX_UNPACKED_MIB, show_default=True,
              help="Refuse a bundle whose members total more MiB unpacked; raise it for a huge bundle you trust.")
@click.option("--max-ratio", metavar="N", type=click.FloatRange(min=1), default=DEFAULT_MAX_RATIO, show_default=True,
              help=f"Refuse a bundle that unpacks to more than N times its size (past {RATIO_FLOOR // MIB} MiB "
                   "unpacked): a decompression bomb.")
@click.option("--tracking-uri", default=None, help=TRACKING_HELP)
@json_option
@expected_errors
def import_(bundle: Path, data_dir: Path | None, max_unpacked_mib: float, max_ratio: float, tracking_uri: str | None,
            as_json: bool) -> None:
    """Verify BUNDLE (from `harness export`) and import its run and replays into this store.

    The manifest's sizes are held to --max-unpacked-mib and --max-ratio before a byte is unpacked, then
    every member to the manifest before anything is written: a bundle with an altered or unlisted
    member, an absolute or `..` name, a link, device, fifo or sparse file, a member larger than listed,
    or a newer format is refused whole. The run keeps its original id as the tag harness.imported_from,
    its metrics, steps and timestamps; `harness replay` then takes its code from the bundled commit.
    An image in the bundle is loaded into the local engine. Importing the same run again writes nothing.
    Prints the run id in this store as the last line. Exit 0 imported or already there, 2 refused.
    """
    from harness.commands import api, documents

    result = api.import_(api.ImportOptions(bundle, data_dir=data_dir, tracking_uri=tracking_uri, on_event=draw,
                                           max_unpacked_mib=max_unpacked_mib, max_ratio=max_ratio))
    if result.already:
        say(f"Run {result.original_id} is already in this store as {result.run_id}; nothing imported.")
    else:
        image = f"; image {result.image} loaded" if result.image else ""
        say(f"Imported run {result.original_id} as {result.run_id} with {len(result.replays)} replays{image}.")
    if result.data:
        # Quoted for a shell: the command is meant to be pasted, and data folders often hold spaces.
        where = shlex.join(["replay", result.run_id, *(w for name, path in sorted(result.data.items())
                                                       for w in ("--data", f"{name}={path}"))])
        say(f"Its declared data is in {', '.join(result.data.values())}: harness {where}")
    if as_json:
        emit(documents.import_(result))
    click.echo(result.run_id)
