"""The only boundary to git: commit, branch, the dirty tree as exact patch bytes, remote URL, replay worktrees."""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import hashlib
import json
import os
import re
import stat
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import scratch
from harness.errors import RepositoryError, SecretRefused
from harness.urls import strip_credentials

# A whole-repository `add -A` or `diff` on a big tree takes seconds; minutes mean git is stuck.
GIT_TIMEOUT_S = 600
MODE_GITLINK = "160000"
MODE_SYMLINK = "120000"
MODE_EXECUTABLE = "100755"
MODE_REGULAR = "100644"
MIB = 1 << 20
# Untracked files with these names usually hold credentials; matched on the file name, any folder.
SECRET_PATTERNS = (
    ".env", ".env.*", "*.env", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*", "id_dsa*", "id_ecdsa*",
    "id_ed25519*", "credentials*", ".netrc", "_netrc", ".pypirc", ".git-credentials", "*.kdbx", "secrets.*",
    "*.harness-key",  # a store's redaction key (record/redaction.py); copies under other names are found by content
)
# Options that pin the patch's format: the user's diff config (noprefix, mnemonicPrefix, color,
# external diff, textconv, renames, context lines, algorithm, order, relative, submodule log
# format) must not change the bytes recorded, nor make a patch that `git apply` rejects.
DIFF_ARGS = (
    "--binary", "--full-index", "--unified=3", "--diff-algorithm=myers", "--indent-heuristic", "--no-renames",
    "--no-color", "--no-ext-diff", "--no-textconv", "--no-relative", "--ignore-submodules=none",
    "--submodule=short", "-O/dev/null", "--src-prefix=a/", "--dst-prefix=b/",
)
# Settings with no command-line option that still change the bytes: fixed, so the same tree gives
# the same patch (and sha256) whoever records it. Names stay readable UTF-8 in the patch.
DIFF_CONFIG = ("core.quotepath=off", "diff.suppressBlankEmpty=false")


@dataclass(frozen=True)
class Submodule:
    """A checked-out submodule as the code record holds it: where, at which commit, and its own uncommitted changes
    (tracked and untracked, as for the repository itself): the superproject's patch cannot hold them."""

    path: str  # relative to the superproject's root, '/'-separated; a nested one's path runs through its parent's
    commit: str
    patch: bytes
    untracked: tuple[str, ...] = ()  # relative to the submodule's folder
    tree: str = ""  # the git tree its working tree made when recorded (not in the record: a close compares to it)


@dataclass(frozen=True)
class GitState:
    root: Path
    commit: str
    branch: str | None  # None on a detached HEAD
    dirty: bool  # uncommitted changes in the repository or in any submodule
    patch: bytes  # tracked and untracked (not ignored) changes against `commit`, exact bytes, never decoded
    repo_url: str | None  # origin's URL with any credentials stripped
    excluded: tuple[str, ...] = ()  # paths left out of the record though not ignored (the store's own files)
    untracked: tuple[str, ...] = ()  # untracked, not ignored files the patch records, relative to `root`
    submodules: tuple[Submodule, ...] = ()  # the checked-out ones, parents before their own submodules
    redacted: tuple[str, ...] = ()  # `path:line` whose secrets were cut from `patch`: it no longer rebuilds the tree
    # The git tree the working tree made when it was read (`commit` + the unredacted patch), written to the object
    # store: what changed_files() compares the working tree with when the run closes.
    tree: str = ""


def submodules_json(submodules: Sequence[Submodule]) -> bytes:
    """The submodules as recorded (ARTIFACT_SUBMODULES): the patches' exact bytes in base64."""
    return json.dumps({"submodules": [
        {"path": s.path, "commit": s.commit, "patch": base64.b64encode(s.patch).decode("ascii"),
         "untracked": list(s.untracked)} for s in submodules]}, indent=1, sort_keys=True).encode()


def submodules_from_json(raw: bytes) -> tuple[Submodule, ...]:
    """The submodules of a record (ValueError when it is not one)."""
    try:
        items = json.loads(raw)["submodules"]
        out = tuple(Submodule(str(i["path"]), str(i["commit"]), base64.b64decode(i["patch"], validate=True),
                              tuple(map(str, i.get("untracked", ())))) for i in items)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"not a record of submodules ({err})") from None
    for sub in out:
        parts = sub.path.split("/")
        if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", sub.commit) or sub.path.startswith("/") or \
                any(part in ("", ".", "..", ".git") for part in parts):
            raise ValueError(f"submodule path {sub.path!r} or commit {sub.commit!r} is not one git would hold")
    return out


@dataclass(frozen=True)
class Mismatch:
    """Where a patch applied to its commit does not rebuild a tree; `path` None means the tree as a whole."""

    path: str | None
    expected: str
    found: str


class GitFailed(RepositoryError):
    """A git command exited non-zero; `detail` is the last line git wrote to stderr."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def gitpython():
    """The `git` module of gitpython, imported on first use: importing it spawns `git` to check the install, which
    `harness --help` and the commands that never read a repository should not pay for."""
    import git

    return git


def run_git(
    cwd: Path, args: list[str], index: Path | None = None, config: tuple[str, ...] = (), stdin: bytes | None = None
) -> bytes:
    """`git -c CONFIG.. ARGS` in `cwd`, stdout as bytes; with `index`, against that index file, not the user's."""
    env = dict(os.environ)
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    try:
        proc = subprocess.run(
            ["git", *(arg for item in config for arg in ("-c", item)), *args],
            cwd=cwd, env=env, capture_output=True, timeout=GIT_TIMEOUT_S, check=False, input=stdin,
        )
    except subprocess.TimeoutExpired:
        raise RepositoryError(
            f"`git {args[0]}` in '{cwd}' did not finish within {GIT_TIMEOUT_S} s. "
            "Check the repository with `git status` (a lock file, a huge untracked folder)."
        ) from None
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        detail = lines[-1] if lines else f"exit {proc.returncode}"
        raise GitFailed(f"`git {args[0]}` failed in '{cwd}': {detail}. Check the repository with `git status`.", detail)
    return proc.stdout


# Folders training frameworks write into their working folder, which in a rank is the experiment folder (code):
# Lightning's logs and checkpoints, wandb's run files, Hydra's outputs, MLflow's file store.
FRAMEWORK_OUTPUTS = ("lightning_logs", "wandb", "outputs", "mlruns")


def framework_outputs(paths: tuple[str, ...] | list[str]) -> list[str]:
    """The framework output folders (FRAMEWORK_OUTPUTS) that `paths` (repository-relative) lie in, in order."""
    found: list[str] = []
    for path in paths:
        for part in path.split("/")[:-1]:
            if part in FRAMEWORK_OUTPUTS and part + "/" not in found:
                found.append(part + "/")
    return found


def framework_hint(folders: list[str]) -> str:
    """What to do about framework output folders in the code record ("" when there are none)."""
    if not folders:
        return ""
    shown = ", ".join(folders)
    return (f" {shown} {'is' if len(folders) == 1 else 'are'} what a training framework writes into its working "
            "folder, which in a rank is the experiment folder: point it at ctx.output_dir (Lightning: "
            "Trainer(default_root_dir=ctx.output_dir) or **harness.lightning.trainer_kwargs(ctx); wandb: "
            f"wandb.init(dir=ctx.output_dir)), and add {shown} to .gitignore.")


def first_few(names: tuple[str, ...] | list[str], limit: int = 5) -> str:
    """`'a', 'b', 'c' and 4 more`: names for a one-line message, however many there are."""
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def shown_path(path: bytes) -> str:
    """A git path for a one-line message (never for git itself): a newline or a byte that is not
    UTF-8 in a name is shown escaped, so the message stays one printable line."""
    text = os.fsdecode(path)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def open_repo(path: Path):
    git = gitpython()
    try:
        return git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise RepositoryError(
            f"'{path}' is not inside a git repository; harness records the commit of every run. "
            "Run `git init` and commit the experiment first."
        ) from None


def inspect(
    path: Path, *, max_untracked_mib: float | None, allow_secrets: bool = False, exclude: tuple[Path, ...] = ()
) -> GitState:
    """Read the repository holding `path`; the user's index and tree are never modified.

    Refuses (HarnessError) a tree the patch could not hold exactly: untracked secrets (unless
    `allow_secrets`), untracked files over `max_untracked_mib` MiB (None: no limit), nested
    repositories and moved submodules, and files git stores differently from their bytes on disk.
    Paths in `exclude` (a tracking store inside the repository) are left out of the record; those
    present and not ignored are named in `GitState.excluded`.
    """
    repo = open_repo(path)
    if not repo.head.is_valid():
        raise RepositoryError(f"git repository '{repo.working_tree_dir}' has no commits yet. Commit the experiment first.")
    root = Path(repo.working_tree_dir)
    commit = repo.head.commit.hexsha
    branch = None if repo.head.is_detached else repo.active_branch.name
    pathspec, excluded = _exclusions(root, exclude)
    # Before `add -A`: a secret or a huge file must not even be hashed into the object store.
    untracked = _check_untracked(root, max_untracked_mib, allow_secrets, pathspec)
    patch, tree = _working_tree_patch(root, commit, pathspec)
    submodules = tuple(_submodules(root, commit, "", max_untracked_mib, allow_secrets))
    url = None
    with contextlib.suppress(Exception):
        remote = repo.remotes.origin if "origin" in repo.remotes else (repo.remotes[0] if repo.remotes else None)
        url = strip_credentials(next(remote.urls)) if remote is not None else None
    dirty = bool(patch) or any(s.patch for s in submodules)
    return GitState(root, commit, branch, dirty, patch, url, excluded, untracked, submodules, tree=tree)


def _gitlinks(root: Path, commit: str) -> list[tuple[bytes, str]]:
    """(path, commit) of every submodule `commit` records (its gitlinks)."""
    out = run_git(root, ["ls-tree", "-r", "-z", "--full-tree", commit])
    links = []
    for entry in filter(None, out.split(b"\0")):
        meta, _, path = entry.partition(b"\t")
        mode, _, object_id = meta.decode("ascii").split(" ")
        if mode == MODE_GITLINK:
            links.append((path, object_id))
    return links


def _submodules(root: Path, commit: str, prefix: str, max_mib: float | None, allow_secrets: bool) -> Iterator[Submodule]:
    """Every checked-out submodule of the tree at `root` (at `commit`), and theirs: commit and exact patch each.

    The superproject's `add -A` sees a submodule only as its commit, so an edit inside one would go unrecorded (and
    the tree be called clean): each is read as a repository of its own, with the same refusals. One not checked out
    (`git submodule update --init` never ran) is an empty folder, as a replay's checkout leaves it."""
    for rel, recorded in _gitlinks(root, commit):
        sub_root = Path(os.fsdecode(os.path.join(os.fsencode(root), rel)))
        if not (sub_root / ".git").exists():
            continue
        path = prefix + os.fsdecode(rel)
        head = run_git(sub_root, ["rev-parse", "--verify", "-q", "HEAD"]).strip().decode("ascii")
        if head != recorded:  # the superproject's own check (_refuse_gitlinks) sees this first; a nested one's is here
            raise RepositoryError(
                f"submodule '{shown_path(os.fsencode(path))}' is checked out at {head[:12]}, not at the commit recorded "
                f"in {commit[:12]}; the code record cannot hold a submodule change. Commit the submodule update, or check it out at the "
                "recorded commit."
            )
        untracked = _check_untracked(sub_root, max_mib, allow_secrets, [], shown_path(os.fsencode(path)) + "/")
        patch, tree = _working_tree_patch(sub_root, recorded, [])
        yield Submodule(path, recorded, patch, untracked, tree)
        yield from _submodules(sub_root, recorded, path + "/", max_mib, allow_secrets)


def _exclusions(root: Path, paths: tuple[Path, ...]) -> tuple[list[str], tuple[str, ...]]:
    """(pathspec selecting the tree without `paths`, those of `paths` present there and not ignored)."""
    top = root.resolve()
    inside = []
    for path in paths:
        with contextlib.suppress(ValueError):
            inside.append(Path(path).resolve().relative_to(top).as_posix())
    inside = [rel for rel in inside if rel != "."]
    present = [rel for rel in inside if (top / rel).exists()]
    ignored = set()
    if present:
        names = b"".join(os.fsencode(rel) + b"\0" for rel in present)
        try:  # check-ignore exits 1 when none of them is ignored
            ignored = {os.fsdecode(p) for p in run_git(root, ["check-ignore", "-z", "--stdin"], stdin=names).split(b"\0") if p}
        except GitFailed:
            ignored = set()
    excluded = tuple(rel for rel in present if rel not in ignored)
    # Only what git would otherwise add: naming an ignored path in a pathspec makes `git add` fail.
    spec = [".", *(f":(exclude,literal){rel}" for rel in excluded)] if excluded else []
    return spec, excluded


def secret_pattern(name: bytes) -> str | None:
    """The pattern of SECRET_PATTERNS the file name matches, if any (case-insensitive)."""
    base = os.fsdecode(name).rsplit("/", 1)[-1].lower()
    return next((p for p in SECRET_PATTERNS if fnmatch.fnmatchcase(base, p)), None)


def _check_untracked(root: Path, max_mib: float | None, allow_secrets: bool, pathspec: list[str],
                     shown: str = "") -> tuple[str, ...]:
    """Refuse untracked files the record must not or cannot hold; returns the untracked files it will hold.
    `shown`: what messages put before a path (a submodule's own path and a slash)."""
    out = run_git(root, ["ls-files", "-z", "--others", "--exclude-standard", "--", *pathspec])
    secrets: list[tuple[bytes, str]] = []
    names = tuple(shown_path(rel) for rel in filter(None, out.split(b"\0")))
    sizes: list[tuple[int, bytes]] = []  # every untracked file the patch will hold: the limit bounds their total too
    for rel in filter(None, out.split(b"\0")):
        # ls-files stops at a nested repository and names its folder with a trailing slash.
        if rel.endswith(b"/"):
            raise RepositoryError(
                f"'{shown}{shown_path(rel.rstrip(b'/'))}' is an untracked git repository inside the repository; the code record "
                "cannot hold it. Add it to .gitignore, or add it as a submodule and commit the submodule."
            )
        pattern = secret_pattern(rel)
        if pattern is not None and not allow_secrets:
            secrets.append((rel, pattern))
            continue
        if max_mib is None:
            continue
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile: `add -A` will not see it either
            size = os.lstat(os.path.join(os.fsencode(root), rel)).st_size
            if size > max_mib * MIB:
                raise RepositoryError(
                    f"'{shown}{shown_path(rel)}' is an untracked file of {size / MIB:.2f} MiB ({size} bytes), over the code "
                    f"record's limit of {max_mib:g} MiB (record.max_untracked_mib). Commit it, add it to "
                    "a .gitignore, or keep data outside the repository and declare it as data; or raise the "
                    "limit (record.max_untracked_mib=50)." + framework_hint(framework_outputs([shown_path(rel)]))
                )
            sizes.append((size, rel))
    total = sum(size for size, _ in sizes)
    if max_mib is not None and total > max_mib * MIB:
        largest = ", ".join(f"'{shown_path(rel)}' ({size / MIB:.2f} MiB)" for size, rel in sorted(sizes, reverse=True)[:3])
        raise RepositoryError(
            f"the {len(sizes)} untracked files hold {total / MIB:.2f} MiB ({total} bytes) together, over the code "
            f"record's limit of {max_mib:g} MiB (record.max_untracked_mib), which bounds their total as well as each "
            f"one; the largest: {largest}. Commit them, add them to a .gitignore, or keep data outside "
            "the repository and declare it as data; or raise the limit (record.max_untracked_mib=50)."
            + framework_hint(framework_outputs([shown_path(rel) for _, rel in sizes]))
        )
    if len(secrets) == 1:
        (rel, pattern), = secrets
        raise SecretRefused(
            f"'{shown}{shown_path(rel)}' is an untracked file whose name marks it as a secret ({pattern}); it would be "
            "stored with the run's code. Add it to .gitignore, commit it if it holds no secret, or pass "
            "--allow-untracked-secrets knowingly."
        )
    if secrets:  # every one at once: fixing them one run at a time would be tedious
        raise SecretRefused(
            f"{first_few([shown + shown_path(rel) for rel, _ in secrets], 10)} are untracked files whose names mark them as "
            "secrets; they would be stored with the run's code. Add them to .gitignore, commit those that hold no secret, "
            "or pass --allow-untracked-secrets knowingly."
        )
    return names


def _working_tree_patch(root: Path, commit: str, pathspec: list[str]) -> tuple[bytes, str]:
    """(the exact patch from `commit` to the working tree, untracked files included; the tree they make)."""
    with scratch.folder("index") as tmp:
        # A throwaway index seeded from HEAD: `add -A` then sees untracked files too, and the
        # user's real index (staged work) stays exactly as it was.
        index = Path(tmp, "index")
        run_git(root, ["read-tree", commit], index)
        # safecrlf would stop `add` with git's own message; the round trip below names the file instead.
        run_git(root, ["add", "-A", "--", *pathspec], index, ("core.safecrlf=false",))
        _refuse_gitlinks(root, commit, index)
        patch = run_git(root, ["diff", "--cached", *DIFF_ARGS, commit], index, DIFF_CONFIG)
        tree = run_git(root, ["write-tree"], index).strip().decode("ascii")
        if not patch:
            return b"", tree
        mismatch = verify_patch(root, commit, patch, root, expected_tree=tree)
        if mismatch is None:
            return patch, tree
        if mismatch.path is None:
            raise RepositoryError(
                f"the patch of the uncommitted changes in {root} does not rebuild them (tree {mismatch.found} "
                f"instead of {mismatch.expected}). Commit the changes and run again."
            )
        raise RepositoryError(
            f"'{mismatch.path}' cannot be recorded exactly: git stores it differently from its bytes on disk "
            "(a .gitattributes filter or eol setting, or core.autocrlf). Commit it, or remove the attribute for it."
        )


def changed_files(state: GitState, since_ns: int | None = None) -> tuple[list[str], list[str]]:
    """The files of `state`'s code record the working tree no longer holds as recorded - edited, deleted, or a Python
    source added since (the ranks may import it) - and, with `since_ns` (time.time_ns() before `state` was read),
    those written since that hold the recorded bytes again (changed and changed back: the ranks may have imported
    the change in between). '/'-separated from the repository's root; ([], []) when none.

    Other files added since are left alone: what a training writes into its folder (logs, checkpoints) is no code;
    so are Python's bytecode caches (__pycache__/*.pyc), which an import rewrites. Nothing of the user's index or tree is touched.
    """
    spec = [".", *(f":(exclude,literal){rel}" for rel in state.excluded)] if state.excluded else []
    changed, written = _changed_since(state.root, state.tree, spec, "", since_ns)
    for sub in state.submodules:
        sub_root = Path(os.fsdecode(os.path.join(os.fsencode(state.root), os.fsencode(sub.path))))
        if not (sub_root / ".git").exists():
            changed.append(f"{sub.path}/")
            continue
        more, again = _changed_since(sub_root, sub.tree, [], f"{sub.path}/", since_ns)
        changed += more
        written += again
    return changed, written


def _changed_since(root: Path, tree: str, pathspec: list[str], shown: str,
                   since_ns: int | None) -> tuple[list[str], list[str]]:
    if not tree:
        return [], []
    with scratch.folder("index") as tmp:
        # A throwaway index seeded from the recorded tree: `add -u` takes the working tree's bytes for the files it
        # holds, and adds none it does not (a huge output is never hashed into the object store).
        index = Path(tmp, "index")
        run_git(root, ["read-tree", tree], index)
        run_git(root, ["add", "-u", "--", *pathspec], index, ("core.safecrlf=false",))
        now = run_git(root, ["write-tree"], index).strip().decode("ascii")
        changed = [] if now == tree else [
            p for p in run_git(root, ["diff-tree", "-r", "-z", "--name-only", "--no-renames", tree, now]).split(b"\0") if p]
        # Untracked as this index sees them: not in the recorded tree, and not ignored.
        added = run_git(root, ["ls-files", "-z", "--others", "--exclude-standard", "--", *pathspec], index)
        changed += [p for p in added.split(b"\0") if p.endswith(b".py")]
        # Python's caches of its sources, rewritten by any import of a source newer than its cache: the sources
        # are what is held to the record.
        changed = [p for p in changed if not _bytecode(p)]
        written = []
        if since_ns is not None:
            seen = set(changed)
            for p in run_git(root, ["ls-files", "-z", "--cached", "--", *pathspec], index).split(b"\0"):
                if not p or p in seen or _bytecode(p):
                    continue
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(os.fsencode(root), p))
                    # ctime too: a file moved into place (an editor's save) keeps the mtime it was written with.
                    if not stat.S_ISDIR(st.st_mode) and max(st.st_mtime_ns, st.st_ctime_ns) >= since_ns:
                        written.append(p)
    return [shown + shown_path(p) for p in changed], [shown + shown_path(p) for p in written]


def _bytecode(path: bytes) -> bool:
    return path.endswith(b".pyc") and b"__pycache__/" in path


def _raw_changes(cwd: Path, commit: str, index: Path) -> list[tuple[str, str, str, bytes]]:
    """(old mode, new mode, new blob id, path) of every entry of `index` that differs from `commit`."""
    out = run_git(cwd, ["diff-index", "--cached", "-z", "--raw", "--no-abbrev", "--no-renames",
                     "--ignore-submodules=none", commit], index)
    fields = out.split(b"\0")
    changes = []
    for meta, path in zip(fields[0::2], fields[1::2]):
        if meta.startswith(b":"):
            old_mode, new_mode, _, new_id, _ = meta[1:].decode("ascii").split(" ")
            changes.append((old_mode, new_mode, new_id, path))
    return changes


def _refuse_gitlinks(root: Path, commit: str, index: Path) -> None:
    for old_mode, new_mode, new_id, path in _raw_changes(root, commit, index):
        if MODE_GITLINK in (old_mode, new_mode):
            # Untracked nested repositories are refused earlier; this is a submodule whose checkout moved.
            raise RepositoryError(
                f"submodule '{shown_path(path)}' is checked out at {new_id[:12]}, not at the commit recorded in "
                f"{commit[:12]}; the code record cannot hold a submodule change. Commit the submodule update "
                f"(git add '{shown_path(path)}' && git commit), or check it out at the recorded commit."
            )


def repo_object_format(cwd: Path) -> str:
    """The hash the repository at `cwd` names its objects with (`sha1` or `sha256`): a copy must use the same one."""
    return run_git(cwd, ["rev-parse", "--show-object-format"]).strip().decode("ascii")


def blob_id(data: bytes, object_format: str = "sha1") -> str:
    """The id git gives a blob of exactly these bytes (no filters)."""
    return hashlib.new(object_format, b"blob %d\0" % len(data) + data).hexdigest()


def _on_disk(path: bytes, object_format: str) -> tuple[str, str] | None:
    """(mode, blob id) of the file at `path` as git would store it raw, None when nothing is there."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        return MODE_SYMLINK, blob_id(os.readlink(path), object_format)
    if stat.S_ISDIR(st.st_mode):
        return None  # a folder where a file was: the file itself is gone
    with open(path, "rb") as fh:
        data = fh.read()
    # git's own test: the owner's executable bit.
    return (MODE_EXECUTABLE if st.st_mode & stat.S_IXUSR else MODE_REGULAR), blob_id(data, object_format)


def _describe(entry: tuple[str, str] | None) -> str:
    return "absent" if entry is None else f"mode {entry[0]} blob {entry[1]}"


def verify_patch(
    repo_root: Path, commit: str, patch: bytes, tree_root: Path, expected_tree: str | None = None
) -> Mismatch | None:
    """Apply `patch` to `commit` in a scratch index and compare every path it touches with `tree_root`.

    Regular files by the blob id of their raw bytes and their executable bit, symlinks by the blob id
    of their target, deleted paths by absence. With `expected_tree`, the scratch index must also
    write exactly that tree, so no change was left out of the patch. None when all match.
    """
    object_format = repo_object_format(repo_root)
    file_mode = run_git(repo_root, ["config", "--type=bool", "--default=true", "core.fileMode"]).strip() == b"true"
    with scratch.folder("index") as tmp:
        index = Path(tmp, "index")
        patch_file = Path(tmp, "uncommitted.patch")
        patch_file.write_bytes(patch)
        run_git(repo_root, ["read-tree", commit], index)
        run_git(repo_root, ["apply", "--cached", "--binary", "--whitespace=nowarn", str(patch_file)], index)
        if expected_tree is not None:
            tree = run_git(repo_root, ["write-tree"], index).strip().decode("ascii")
            if tree != expected_tree:
                return Mismatch(None, expected_tree, tree)
        root = os.fsencode(tree_root)
        for _, new_mode, new_id, path in _raw_changes(repo_root, commit, index):
            expected = None if set(new_id) == {"0"} else (new_mode, new_id)
            found = _on_disk(os.path.join(root, path), object_format)
            regular = {MODE_REGULAR, MODE_EXECUTABLE}
            if not file_mode and expected and found and {expected[0], found[0]} <= regular:
                found = (expected[0], found[1])  # core.fileMode=false: git ignores the executable bit, so do we
            if expected != found:
                return Mismatch(shown_path(path), _describe(expected), _describe(found))
    return None


def has_commit(root: Path, commit: str) -> bool:
    git = gitpython()
    repo = open_repo(root)
    try:
        repo.commit(commit)
        return True
    except (ValueError, git.BadName, git.GitCommandError):
        return False


def commits_between(root: Path, older: str, newer: str) -> list[tuple[str, str]]:
    """(sha, subject) of each commit on the ancestry path from `older` (excluded) to `newer` (included), oldest first.
    Empty when `older` is no ancestor of `newer` (the caller says so)."""
    if not is_ancestor(root, older, newer):
        return []
    out = run_git(root, ["log", "--ancestry-path", "--first-parent", "--reverse", "--format=%H %s", f"{older}..{newer}"])
    return [(line[:40], line[41:]) for line in out.decode(errors="replace").splitlines() if line.strip()]


def is_ancestor(root: Path, older: str, newer: str) -> bool:
    try:
        run_git(root, ["merge-base", "--is-ancestor", older, newer])
        return True
    except GitFailed:
        return False


def find_repo(path: Path) -> Path | None:
    """The working tree of the repository holding `path`, None when there is none."""
    git = gitpython()
    try:
        return Path(git.Repo(path, search_parent_directories=True).working_tree_dir)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None


def recorded_symlinks(root: Path, folder: Path) -> list[Path]:
    """The symbolic links under `folder` that the code record holds: tracked, or untracked and not ignored."""
    try:
        rel = Path(folder).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return []
    spec = ["--", rel] if rel != "." else []
    links = [p[p.index(b"\t") + 1:] for p in run_git(root, ["ls-files", "-z", "-s", *spec]).split(b"\0")
             if p.startswith(MODE_SYMLINK.encode())]
    others = [p for p in run_git(root, ["ls-files", "-z", "--others", "--exclude-standard", *spec]).split(b"\0") if p]
    out = [Path(os.fsdecode(os.path.join(os.fsencode(root), p))) for p in links]
    out += [path for p in others if (path := Path(os.fsdecode(os.path.join(os.fsencode(root), p)))).is_symlink()]
    return out
