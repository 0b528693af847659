"""A bundle's format: its layout, its manifest, and the verification every member passes before anything of it is
used (harness/commands/bundle.py exports and imports with it)."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from harness.errors import HarnessError, UsageError
from harness.fmt import plain_name

# The layout this code writes; a bundle with a higher number comes from a newer harness and is refused.
FORMAT = 1
MANIFEST = "manifest.json"  # the first member: format, what the bundle holds, and every member's size and sha256
RUN_DIR = "run"  # run/record.json + run/artifacts/...
REPLAYS_DIR = "replays"  # replays/<original replay id>/record.json + artifacts/...
RECORD = "record.json"  # info, params, tags and every metric write (value as float.hex, timestamp, step)
ARTIFACTS = "artifacts"
CODE_BUNDLE = "code/code.bundle"  # `git bundle` of the recorded commit
IMAGE_TAR = "image/image.tar"  # `docker save` of the pinned image (--with-image)
DATA_DIR = "data"  # data/<name>/<file>: the declared data's bytes (--with-data); its manifest is an artifact
# The manifest is read whole before anything is checked against it: a bound keeps a hostile one from filling memory.
MAX_MANIFEST_BYTES = 64 << 20
_CHUNK = 1 << 20
# The way out of every refusal of a damaged or hostile bundle, the last words of its error.
DAMAGED_FIX = "Export the run again from its store, or ask whoever sent it for an intact copy."
MIB = 1 << 20
# How far an import lets a bundle unpack, checked on the manifest's sizes before any member is unpacked: a manifest
# that lists a member's true size and sha256 passes every other check, so only these bound a decompression bomb.
DEFAULT_MAX_UNPACKED_MIB = 64 << 10  # 64 GiB: an image and a few checkpoints fit; more takes --max-unpacked-mib
# What export writes (records, npz series, a git pack, checkpoints, a docker save) shrinks under 10 times at gzip
# level 1; gzip shrinks nothing more than about 1032 times, which 1 GiB of zeros in 1 MB reaches.
DEFAULT_MAX_RATIO = 100
RATIO_FLOOR = 64 * MIB  # unpacked, a bundle may always reach this: a small bundle's ratio says nothing
# After its last member a tar holds two zero blocks padded to a 10 KiB record; more is data no member header
# accounted for (a header that understates its member's size, and the rest read as no header at all).
_MAX_TAIL = 64 << 10


class BundleError(HarnessError):
    """A bundle that cannot be trusted or read; nothing was written."""


@dataclass(frozen=True)
class Member:
    size: int
    sha256: str


@dataclass
class Manifest:
    format: int
    run_id: str
    replays: list[str]
    members: dict[str, Member]
    image: dict[str, str] | None = None  # {"ref", "id"}: what --with-image saved

    def to_json(self) -> bytes:
        return json.dumps({
            "format": self.format, "run_id": self.run_id, "replays": self.replays, "image": self.image,
            "members": {name: {"size": m.size, "sha256": m.sha256} for name, m in sorted(self.members.items())},
        }, indent=1).encode()


@dataclass(frozen=True)
class Limits:
    """How large a bundle may unpack, checked on its manifest before any member is unpacked: the sum of every
    member's listed size, and that sum over the bundle file's size (above RATIO_FLOOR)."""

    max_unpacked_mib: float = DEFAULT_MAX_UNPACKED_MIB  # harness import --max-unpacked-mib
    max_ratio: float = DEFAULT_MAX_RATIO  # harness import --max-ratio

    def __post_init__(self) -> None:
        if not (self.max_unpacked_mib > 0 and self.max_ratio >= 1):
            raise UsageError(f"import limits must be positive, and a ratio at least 1 (got --max-unpacked-mib "
                             f"{self.max_unpacked_mib:g}, --max-ratio {self.max_ratio:g}).")

    def check(self, manifest: Manifest, packed: int) -> None:
        """Refuse a manifest whose members total more than the limits allow for a bundle file of `packed` bytes."""
        if not manifest.members:
            return
        total = sum(m.size for m in manifest.members.values())
        name, largest = max(manifest.members.items(), key=lambda item: (item[1].size, item[0]))
        what = (f"bundle member '{_shown(name)}' ({largest.size} bytes) is the largest of {len(manifest.members)} "
                f"that unpack to {total} bytes")
        trust = "refused before anything was unpacked. If you trust where the bundle came from, import it with"
        if total > self.max_unpacked_mib * MIB:
            raise BundleError(f"{what}, over the import's limit of {self.max_unpacked_mib:g} MiB; {trust} "
                              f"--max-unpacked-mib {math.ceil(total / MIB)}.")
        ratio = total / max(packed, 1)
        if total > RATIO_FLOOR and ratio > self.max_ratio:
            raise BundleError(f"{what}, {ratio:.0f} times the bundle's {packed} bytes, over the import's limit of "
                              f"{self.max_ratio:g} times (a decompression bomb shrinks that much); {trust} "
                              f"--max-ratio {math.ceil(ratio)}.")


# -- names and the manifest ------------------------------------------------------------------------
def _shown(name: str) -> str:
    """A member name for a one-line message: control characters escaped."""
    return name if name.isprintable() else name.encode("unicode_escape").decode("ascii")


def check_name(name: str) -> None:
    """Refuse a member name that could land outside the folder it is extracted into."""
    if not name or name.startswith("/") or "\\" in name or (len(name) > 1 and name[1] == ":"):
        raise BundleError(f"bundle member '{_shown(name)}' has an absolute name; refused. {DAMAGED_FIX}")
    parts = PurePosixPath(name).parts
    if ".." in name.split("/"):
        raise BundleError(f"bundle member '{_shown(name)}' climbs out of the bundle ('..'); refused. {DAMAGED_FIX}")
    if any(p in ("", ".") for p in name.rstrip("/").split("/")) or not parts:
        raise BundleError(f"bundle member '{_shown(name)}' is not a plain relative name; refused. {DAMAGED_FIX}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: a key given twice is refused (json.loads would keep the last one silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def load_document(data: bytes) -> Any:
    """A bundle's JSON document; ValueError for one that is malformed, duplicates a key or nests past the stack."""
    try:
        return json.loads(data, object_pairs_hook=_unique_keys)
    except RecursionError:  # a few hundred KB of '[' (harness writes nothing nested past 5 levels)
        raise ValueError("nested too deeply") from None


def check_plain_name(value: Any, what: str) -> str:
    """A name the store turns into a folder or a path segment (an experiment name): no separator, no '..'."""
    if not plain_name(value):
        raise ValueError(f"{what} {value!r} (a plain name: no '/', '\\', '..' or control characters)")
    return value


def parse_manifest(data: bytes) -> Manifest:
    try:
        doc = load_document(data)
    except ValueError as err:
        raise BundleError(f"the bundle's {MANIFEST} is not valid JSON ({err}). {DAMAGED_FIX}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("format"), int):
        raise BundleError(f"the bundle's {MANIFEST} has no format number; this is not a harness bundle. {DAMAGED_FIX}")
    if doc["format"] > FORMAT:
        raise BundleError(
            f"the bundle has format {doc['format']}, newer than this harness reads (up to {FORMAT}); it was made by "
            "a newer harness. Upgrade harness (pip install -U ddp-harness) and import it again."
        )
    try:
        members = {}
        for name, entry in doc["members"].items():
            check_name(name)
            size, digest = entry["size"], entry["sha256"]
            if not (isinstance(size, int) and size >= 0 and isinstance(digest, str) and len(digest) == 64):
                raise ValueError(name)
            int(digest, 16)
            members[name] = Member(size, digest)
        image = doc.get("image")
        if image is not None and not (isinstance(image, dict)
                                      and all(isinstance(image.get(k), str) for k in ("ref", "id"))):
            raise ValueError("image")
        manifest = Manifest(doc["format"], _run_id(doc["run_id"]), [_run_id(r) for r in doc.get("replays") or []],
                            members, image)
    except BundleError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise BundleError(f"the bundle's {MANIFEST} is malformed (at {err!s}). {DAMAGED_FIX}") from None
    if MANIFEST in members:
        raise BundleError(f"the bundle's {MANIFEST} lists itself. {DAMAGED_FIX}")
    return manifest


def _run_id(value: Any) -> str:
    """A run id from a bundle: it names a folder of the bundle and goes into a store query, so only [0-9A-Za-z_-]."""
    if not (isinstance(value, str) and value and len(value) <= 64 and all(c.isalnum() or c in "-_" for c in value)
            and value.isascii()):
        raise ValueError(f"run id {value!r}")
    return value


# -- verification ----------------------------------------------------------------------------------
def _kind(member: tarfile.TarInfo) -> str | None:
    """What a member is when it is neither a regular file nor a folder (refused), else None."""
    if member.issym():
        return "a symbolic link"
    if member.islnk():
        return "a hard link"
    if member.ischr() or member.isblk():
        return "a device"
    if member.isfifo():
        return "a fifo"
    if member.issparse():  # export writes none; its holes unpack to zeros the archive does not hold
        return "a sparse file"
    if not (member.isreg() or member.isdir()):
        return f"of tar type {member.type!r}"
    return None


def _copy_checked(src: IO[bytes], dest: Path, name: str, expected: Member) -> None:
    digest = hashlib.sha256()
    written = 0
    with open(dest, "xb") as out:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > expected.size:
                raise BundleError(
                    f"bundle member '{_shown(name)}' is larger than its manifest says ({expected.size} bytes); "
                    f"refused. {DAMAGED_FIX}"
                )
            digest.update(chunk)
            out.write(chunk)
    if written != expected.size or digest.hexdigest() != expected.sha256:
        raise BundleError(
            f"bundle member '{_shown(name)}' was altered: sha256 {digest.hexdigest()} ({written} bytes), the "
            f"manifest says {expected.sha256} ({expected.size} bytes); refused. {DAMAGED_FIX}"
        )


class _Stream:
    """The bundle's unpacked bytes as tarfile reads them, keeping the last piece read: where the archive ends, the
    block tarfile took for no header, which _check_tail sees without seeking back (gzip seeks back by unpacking the
    bundle again from its start)."""

    def __init__(self, raw: gzip.GzipFile) -> None:
        self.raw, self.last = raw, b""

    def read(self, size: int = -1) -> bytes:
        self.last = self.raw.read(size)
        return self.last

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def seekable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:
        raise OSError("a bundle is read, never written, on import")

    def close(self) -> None:
        self.raw.close()


def _check_tail(tar: tarfile.TarFile, stream: _Stream, archive: Path) -> None:
    """Refuse data after the last member: tarfile ends an archive silently at the first block that is no header."""
    taken = stream.tell() - tar.offset  # the block tarfile read where a header should be, or none
    tail = (stream.last[-taken:] if taken > 0 else b"") + stream.read(_MAX_TAIL + 1)
    if len(tail) > _MAX_TAIL or tail.count(0) != len(tail):
        raise BundleError(f"the bundle '{archive}' holds data after its last member (a member header that understates "
                          f"its size?); refused. {DAMAGED_FIX}")


def verify(archive: Path, dest: Path, limits: Limits | None = None) -> Manifest:
    """Check every member of `archive` against its manifest while copying it into the empty folder `dest`.

    Refuses (BundleError, before anything else is written) a manifest whose sizes exceed `limits` or the free
    disk, links, devices, fifos and sparse files, absolute names, '..', members missing from the manifest,
    listed twice or larger than it says, altered bytes, members the manifest lists but the archive lacks,
    data after the last member, and a format newer than FORMAT. Nothing is unpickled or executed.
    """
    not_bundle = f"'{archive}' is not a harness bundle (a .tar.gz made by harness export)"
    try:
        raw = gzip.open(archive, "rb")
    except FileNotFoundError:
        raise BundleError(f"no bundle at '{archive}'. Pass the file `harness export` wrote.") from None
    except OSError as err:
        raise BundleError(f"{not_bundle}: {err}.") from None
    stream = _Stream(raw)
    try:
        tar = tarfile.open(fileobj=stream, mode="r:")
    except (OSError, tarfile.TarError, EOFError, zlib.error) as err:
        raw.close()
        raise BundleError(f"{not_bundle}: {err}.") from None
    try:
        with raw, tar:
            first = tar.next()
            if first is None or first.name != MANIFEST or not first.isreg():
                raise BundleError(f"'{archive}' does not start with {MANIFEST}; it is not a harness bundle. {DAMAGED_FIX}")
            if first.size > MAX_MANIFEST_BYTES:
                raise BundleError(f"the bundle's {MANIFEST} is {first.size} bytes, over {MAX_MANIFEST_BYTES}. {DAMAGED_FIX}")
            manifest = parse_manifest(tar.extractfile(first).read())  # type: ignore[union-attr]
            (limits or Limits()).check(manifest, archive.stat().st_size)
            needed = sum(m.size for m in manifest.members.values())
            free = shutil.disk_usage(dest).free
            if needed > free:
                raise BundleError(
                    f"the bundle unpacks to {needed} bytes, more than the {free} free in {dest.parent}. "
                    "Free space there (or point TMPDIR at a larger disk) and import again."
                )
            seen: set[str] = set()
            while (member := tar.next()) is not None:
                name = member.name
                kind = _kind(member)
                if kind is not None:
                    raise BundleError(f"bundle member '{_shown(name)}' is {kind}; only files and folders are "
                                      f"accepted. {DAMAGED_FIX}")
                check_name(name)
                name = name.rstrip("/")
                expected = manifest.members.get(name)
                if member.isdir():  # harness export writes files only; its manifest lists no folder
                    raise BundleError(f"bundle member '{_shown(name)}' is a folder the manifest does not list; "
                                      f"refused. {DAMAGED_FIX}")
                if expected is None:
                    raise BundleError(f"bundle member '{_shown(name)}' is not in the manifest; refused. {DAMAGED_FIX}")
                if name in seen:
                    raise BundleError(f"bundle member '{_shown(name)}' appears twice; refused. {DAMAGED_FIX}")
                if member.size > expected.size:
                    raise BundleError(
                        f"bundle member '{_shown(name)}' is larger than its manifest says ({member.size} > "
                        f"{expected.size} bytes); refused. {DAMAGED_FIX}"
                    )
                seen.add(name)
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                _copy_checked(tar.extractfile(member), target, name, expected)  # type: ignore[arg-type]
            _check_tail(tar, stream, archive)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise BundleError(f"the bundle '{archive}' is damaged or cut short: {err}. {DAMAGED_FIX}") from None
    missing = sorted(set(manifest.members) - seen)
    if missing:
        raise BundleError(f"the bundle lacks '{_shown(missing[0])}', which its manifest lists; refused. {DAMAGED_FIX}")
    return manifest
