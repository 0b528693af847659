"""Loading an experiment: experiment.yaml + KEY=VALUE overrides -> a validated, resolved config (the schema's
dataclasses are harness/configschema.py)."""

from __future__ import annotations

import difflib
import enum
import importlib.util
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, errors as oc_errors

from harness.configschema import Backend, Device, ExperimentConfig, ProfileConfig, Schema
from harness.errors import ConfigError

EXPERIMENT_FILE = "experiment.yaml"


def _check_executor(cfg: DictConfig, source: str, schema: Schema) -> None:
    names = schema.names()
    if str(cfg.executor) not in names:
        raise ConfigError(f"{source}: invalid value {cfg.executor!r} for 'executor'; expected one of {', '.join(names)}.")


MAX_SEED = 2**63 - 1  # torch.manual_seed and the samplers' generators take a signed 64-bit seed
NO_IMAGE = "none"  # `image: none`: an experiment that only runs locally pins no container image


def is_no_image(image: str) -> bool:
    return image.strip().lower() == NO_IMAGE


_ENTRY_RE = re.compile(r"^(?P<file>[^:]+\.py):(?P<func>[A-Za-z_][A-Za-z0-9_]*)$")


def _valid_keys(node: Any) -> str:
    try:
        return ", ".join(str(k) for k in node.keys())
    except Exception:  # pragma: no cover - defensive, message only
        return "?"


def _explain(
    err: oc_errors.OmegaConfBaseException, source: str, schema: DictConfig, base: DictConfig, defaults: Any,
) -> ConfigError:
    """Turn an OmegaConf error into one line naming the key and the valid choices."""
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    if isinstance(err, oc_errors.ConfigKeyError):
        parent_key = str(key).rpartition(".")[0]
        parent = OmegaConf.select(schema, parent_key) if parent_key else schema
        hint = ""
        name = str(key).rpartition(".")[2]
        close = difflib.get_close_matches(name, [str(k) for k in parent.keys()], n=1) if parent is not None else []
        if not parent_key and str(key) in (base.get("train") or {}):
            hint = f" Did you mean train.{key}? (the experiment's own settings live under train:)"
        elif close:
            hint = f" Did you mean {parent_key + '.' if parent_key else ''}{close[0]}?"
        return ConfigError(
            f"{source}: unknown key '{key}'.{hint} Valid keys here: {_valid_keys(parent)}."
        )
    if isinstance(err, oc_errors.ValidationError):
        listed = re.sub(r"\[\d+\]$", "", str(key))  # an item of a list (profile.steps[0]): the list's key
        default = _default_of(defaults, listed)
        if isinstance(default, enum.Enum):
            expected = "one of " + ", ".join(m.value for m in type(default))
        elif isinstance(default, list):
            expected = f"a list of integers, e.g. {listed}=[0]"
        else:
            expected = _TYPE_NAMES.get(type(default), "a valid value")
        value = getattr(err, "value", None)
        return ConfigError(f"{source}: invalid value {value!r} for '{key}'; expected {expected}.")
    return ConfigError(f"{source}: {str(err).splitlines()[0]}")


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _default_of(defaults: Any, key: str) -> Any:
    obj: Any = defaults
    for part in key.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            return None
    return obj


def _yaml_words(node: Any, defaults: Any, prefix: str = "") -> Any:
    """YAML 1.1 reads a bare `off` (also `no`, `on`, `yes`) as a boolean: for a field whose values are an Enum
    with a member `off` / `on` (determinism.level), the word the user wrote is meant, not the boolean."""
    if isinstance(node, dict):
        return {k: _yaml_words(v, defaults, f"{prefix}{k}.") for k, v in node.items()}
    if isinstance(node, bool):
        default = _default_of(defaults, prefix.rstrip("."))
        word = "on" if node else "off"
        if isinstance(default, enum.Enum) and word in type(default).__members__:
            return word
    return node


def _merge(base: DictConfig, other: Any, source: str, schema: DictConfig, defaults: Any) -> DictConfig:
    if isinstance(other, DictConfig):
        other = OmegaConf.create(_yaml_words(OmegaConf.to_container(other), defaults))
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except oc_errors.OmegaConfBaseException as err:
        raise _explain(err, source, schema, base, defaults) from None
    except (ValueError, TypeError) as err:  # e.g. a YAML value OmegaConf cannot hold
        raise ConfigError(f"{source}: {str(err).splitlines()[0] if str(err) else type(err).__name__}.") from None


# Hydra's sweep functions: `key=choice(a,b)`, `key=range(1,5)` would be stored as a string here.
_SWEEP_FUNCTION = re.compile(r"\s*(choice|range|interval|glob|sort|shuffle|tag)\s*\(")


def _sweep_values(value: str) -> list[str] | None:
    """The values of a Hydra multirun sweep written as an override's value (`0.1,0.2`, `choice(0.1,0.2)`), else None.

    Only a comma outside quotes, brackets, braces and parentheses makes a sweep: `'a,b'` (quoted), `[1,2]` (a list),
    `{a: 1, b: 2}` and `${oc.env:X,1}` are values, as YAML reads them."""
    if _SWEEP_FUNCTION.match(value):
        return [value.strip()]
    parts, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(value):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth = max(depth - 1, 0)
        elif c == "," and depth == 0:
            parts.append(value[start:i].strip())
            start = i + 1
    return [*parts, value[start:].strip()] if parts else None


def as_override(key: str, text: str) -> str:
    """KEY=TEXT that parse_overrides reads back as TEXT's value, for overrides harness writes itself (a backend's
    option, a bisect probe's value): TEXT (plain YAML) that the sweep rule would refuse, `a,b`, is quoted as the
    string it is, and so is one holding a line break (YAML would fold it into a space; its \\n escape is exact)."""
    quoted = _sweep_values(text) is not None or "\n" in text or "\r" in text
    return f"{key}={json.dumps(text) if quoted else text}"


def _refuse_sweep(item: str, key: str, values: list[str]) -> None:
    """Hydra's `-m key=a,b` runs one job per value; here it would silently be the string "a,b" and fail in a rank."""
    if key.strip() == "seed":
        way = f"for a study of seeds write seeds=[{','.join(values)}] (or --seeds N)"
    elif len(values) > 1:
        way = (f"run one per value (harness run DIR {key}={values[0]}, then {key}={values[1]}, ...)"
               f"{', or seeds=[...] for a study of seeds' if key.strip() != 'seeds' else ''}")
    else:
        way = f"run one per value ({key}=VALUE each)"
    quoted = "" if key.strip() == "seed" else \
        f" A string that holds a comma is quoted: '{key}=\"{values[0] if len(values) == 1 else ','.join(values)}\"'."
    raise ConfigError(f"override '{item}' is Hydra's multirun sweep syntax; harness runs one config per run: {way}."
                      + quoted)


def parse_overrides(overrides: list[str]) -> DictConfig:
    """KEY=VALUE (Hydra-style dotlist) -> a config fragment."""
    seen: dict[str, str] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if "=" not in item or not key.strip():
            raise ConfigError(f"override '{item}' is not KEY=VALUE (e.g. train.lr=0.1).")
        if key[:1] in "+~" and key[1:]:
            # Hydra's +key / ~key: here one KEY=VALUE form both sets keys and adds new ones under train:.
            raise ConfigError(f"override '{item}': drop the '{key[0]}'; write {key[1:]}={value} (KEY=VALUE adds keys under train: too).")
        if any(ord(c) < 32 or ord(c) == 127 for c in key):
            raise ConfigError(f"override {item!r}: its key holds a control character. Type the key again (letters, "
                              "digits, '_' and '.').")
        if "\n" in value or "\r" in value:
            # YAML folds a line break in a scalar into a space: the run would record and run another string than
            # the one typed. In double quotes, \n is YAML's escape for it, read back exactly.
            raise ConfigError(f"override {item!r}: its value holds a line break, which YAML reads as a space, so the "
                              f"run would not get the value typed. Write each line break as \\n inside double quotes "
                              f"({key}=\"first\\nsecond\"), or set the value in {EXPERIMENT_FILE}.")
        if key in seen:
            raise ConfigError(f"override '{key}' is given twice ({seen[key]}, {item}); give it once.")
        seen[key] = item
        if not value.strip():
            # `train.lr=` would silently become None and fail later, inside a rank.
            raise ConfigError(
                f"override '{item}' has no value. Give one ({key}=VALUE), or write {key}=null to set it to null."
            )
        sweep = _sweep_values(value)
        if sweep is not None:
            _refuse_sweep(item, key, sweep)
    fragments = []
    for item in overrides:  # one by one, so that an error names its override
        try:
            fragments.append(OmegaConf.from_dotlist([item]))
        except Exception as err:  # YAML parse errors and OmegaConf's own: the value is the user's, not ours
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"override '{item}' is not a valid value ({first}). Quote strings, e.g. key='a b'.") from None
    try:
        return OmegaConf.merge(*fragments) if fragments else OmegaConf.create()  # type: ignore[return-value]
    except oc_errors.OmegaConfBaseException as err:
        raise ConfigError(f"overrides: {str(err).splitlines()[0]}") from None


_YAML11_WORDS = {"yes", "no", "on", "off"}  # what YAML 1.1 reads as booleans besides true/false


def boolean_words(overrides: list[str], cfg: DictConfig) -> list[str]:
    """A warning for each override whose bare yes/no/on/off became a boolean in `cfg` (YAML 1.1, which OmegaConf
    reads): `eval_strategy=no` gives the code False, not the string "no". A field whose values are words
    (determinism.level=off) keeps the word and is not warned about."""
    said = []
    for item in overrides:
        key, _, value = item.partition("=")
        if value.strip().lower() not in _YAML11_WORDS:
            continue
        held = OmegaConf.select(cfg, key.strip(), default=None, throw_on_missing=False)
        if isinstance(held, bool):
            word, leaf = value.strip(), key.strip().rsplit(".", 1)[-1]
            said.append(
                f"override {item} gives {key.strip()} the boolean {held}, not the string {word!r}: YAML reads a bare "
                f"yes/no/on/off as true/false. To pass the word, quote it for YAML inside the shell's quotes: "
                f"{key.strip()}='\"{word}\"' (the shell alone drops the quotes of {key.strip()}=\"{word}\"); in "
                f"{EXPERIMENT_FILE}: {leaf}: \"{word}\".")
    return said


def compose(sources: list[tuple[str, Any]], schema: Schema) -> DictConfig:
    """Merge config fragments (name, content) onto the schema (harness.executors.schema()) and validate the result."""
    structured = OmegaConf.structured(schema.cls)
    cfg = structured
    for name, content in sources:
        _check_sections(content, structured, name)
        cfg = _merge(cfg, content, name, structured, schema.defaults)
        if isinstance(content, DictConfig) and "executor" in content:
            _check_executor(cfg, name, schema)
    return cfg


def _check_sections(content: Any, schema: DictConfig, source: str, prefix: str = "") -> None:
    """A plain value where the schema has a section (`determinism=strict`): OmegaConf's own error names no key."""
    if not isinstance(content, DictConfig):
        return
    for key in content.keys():
        node = schema.get(key) if key in schema else None
        if not isinstance(node, DictConfig):
            continue
        full = f"{prefix}{key!s}"
        value = content._get_node(key)
        assert value is not None  # key is one of content's keys
        if isinstance(value, DictConfig):
            _check_sections(value, node, source, f"{full}.")
            continue
        keys = [str(k) for k in node.keys()]
        example = f"{full}.{keys[0]}=..." if keys else f"{full}.NAME=..."
        what = f"a section with keys {', '.join(keys)}" if keys else "a section of named settings"
        raise ConfigError(f"{source}: '{full}' is {what}; set them by name (e.g. {example}), not {full}={value._value()!r}.")


@dataclass(frozen=True)
class Experiment:
    """A loaded, validated experiment. `config`: its typed values (the schema's class, with the backends' sections),
    which the launcher, the record and the ranks read. `composed`: the OmegaConf tree they were read from, its
    interpolations unresolved - the edge where OmegaConf is kept: the recorded config.yaml and params are written
    from it, and the record names the environment variable a secret came from (`${oc.env:NAME}`).

    Never changed in place: a change (overrides, --allow-changes, --world-size, a study member's seed) is a new
    Experiment (`with_changes`), composed and validated like the first."""

    config: ExperimentConfig
    composed: DictConfig

    @classmethod
    def of(cls, composed: DictConfig) -> Experiment:
        """The typed experiment of a composed, validated config."""
        typed = OmegaConf.to_object(composed)
        assert isinstance(typed, ExperimentConfig), type(typed)  # compose() builds on Schema.cls
        return cls(typed, composed)

    def with_changes(self, changes: Sequence[tuple[str, Any]], schema: Schema, *, source: str = "config",
                     check: bool = True) -> Experiment:
        """This experiment with `changes` merged in ((source, DictConfig or mapping) pairs, as compose() takes
        them): a new Experiment. `check` False leaves validate() to the caller (where the code is at hand)."""
        composed = compose([(source, self.composed), *changes], schema)
        return Experiment(validate(composed, None, schema), composed) if check else Experiment.of(composed)


def load_experiment(
    exp_dir: Path, overrides: list[str] | None = None, check_entry: bool = True, *, schema: Schema,
) -> Experiment:
    """Read EXP_DIR/experiment.yaml, apply overrides, validate; nothing runs before this passes."""
    exp_dir = Path(exp_dir)
    path = exp_dir / EXPERIMENT_FILE
    if exp_dir.is_file():
        folder = exp_dir.parent.as_posix() or "."
        raise ConfigError(f"'{exp_dir}' is a file; pass the experiment's folder, {folder}")
    if not exp_dir.is_dir():
        raise ConfigError(f"experiment folder '{exp_dir}' does not exist. Pass a folder holding {EXPERIMENT_FILE}.")
    if not path.is_file():
        raise ConfigError(f"'{exp_dir}' has no {EXPERIMENT_FILE}. Create one (see docs/experiment-format.md).")
    try:
        content = _load_yaml(path)
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "expansion exceeds" in first:
            first = "its YAML aliases expand to far more nodes than the file has lines"
        raise ConfigError(f"{path}: not valid YAML ({first}).") from None
    if not isinstance(content, DictConfig):
        raise ConfigError(f"{path}: must be a mapping of keys (image, entry, world_size, ...).")
    sources: list[tuple[str, Any]] = [(str(path), content)]
    if overrides:
        sources.append(("overrides", parse_overrides(overrides)))
    cfg = compose(sources, schema)
    return Experiment(validate(cfg, exp_dir if check_entry else None, schema), cfg)


def _load_yaml(path: Path) -> Any:
    """OmegaConf.load with its alias-expansion guard sized to the file: 20,000 plain keys are a config, not an alias
    bomb (which expands a few lines into millions of nodes)."""
    lines = path.read_bytes().count(b"\n") + 1
    try:
        return OmegaConf.load(path, max_yaml_expanded_nodes=max(10_000, 4 * lines))  # type: ignore[call-arg, unused-ignore]  # only newer OmegaConf takes it
    except TypeError:  # an OmegaConf without the guard
        return OmegaConf.load(path)


def check_resolvable(cfg: DictConfig) -> None:
    """Every interpolation resolves now (`${train.x}` naming itself, `${oc.env:UNSET}`): `check` must say what a
    run would otherwise fail on inside a rank, after it was recorded."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except oc_errors.OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or ""
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"{key or 'the config'}: an interpolation cannot be resolved ({first}). Fix the ${{...}} reference, or give "
            "an environment variable a default: ${oc.env:NAME,default}."
        ) from None


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_nodes(nnodes: int, world_size: int, what: str) -> None:
    """A job of world_size ranks on nnodes nodes runs the same number of ranks on each."""
    if nnodes < 1:
        raise ConfigError(f"{what} must be >= 1, got {nnodes}.")
    if world_size % nnodes:
        raise ConfigError(
            f"world_size {world_size} cannot be split evenly over {nnodes} nodes ({what}). "
            f"Use a world_size that is a multiple of {nnodes}."
        )


def check_layout(shards: int, world_size: int) -> None:
    """Refuse a shard count K and world size W for which ranks cannot own whole subtrees of the K-shard tree."""
    if not is_power_of_two(shards):
        up = 1 << max(shards - 1, 0).bit_length()
        raise ConfigError(f"invariant shards={shards} is not a power of two. Use a power of two such as {up}.")
    if not is_power_of_two(world_size):
        raise ConfigError(
            f"invariant mode needs a power-of-two world_size, got {world_size}. Use 1, 2, 4, ... up to shards={shards}."
        )
    if shards % world_size:
        raise ConfigError(
            f"invariant shards={shards} is not a multiple of world_size={world_size}. "
            f"Raise shards to at least {world_size} or lower world_size to at most {shards}."
        )


def check_profile(profile: ProfileConfig, world_size: int) -> None:
    """profile.steps are step indexes (>= 0, each once), profile.ranks ranks of this world, samples_per_step >= 0."""
    steps, ranks = list(profile.steps), list(profile.ranks)
    bad = [s for s in steps if s < 0]
    if bad:
        raise ConfigError(f"profile.steps holds {bad[0]}; steps are counted from 0 (e.g. profile.steps=[3]).")
    if len(set(steps)) != len(steps):
        raise ConfigError(f"profile.steps lists a step more than once ({steps}); give each step once.")
    if not ranks:
        raise ConfigError("profile.ranks is empty; give the ranks to profile (e.g. profile.ranks=[0]).")
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside:
        raise ConfigError(f"profile.ranks holds {outside[0]}, which is no rank of world_size={world_size}; "
                          f"use ranks 0 to {world_size - 1}.")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"profile.ranks lists a rank more than once ({ranks}); give each rank once.")
    if profile.samples_per_step < 0:
        raise ConfigError(f"profile.samples_per_step must be >= 0 (0: counted from ctx.loader), "
                          f"got {profile.samples_per_step}.")


# Above this many profiled steps (steps x ranks), the run is told what they cost before it starts.
PROFILE_MANY = 10
# What one profiled step writes (trace, table, summary) for the smallest model worth profiling: 25 profiled steps of
# experiments/linear_ddp (one Linear(10, 5) under DDP on gloo) wrote 1.85 MB. Each op a step runs adds to it.
PROFILE_STEP_KB = 70


def profile_warning(profile: ProfileConfig) -> str | None:
    """The cost of many profiled steps, said before the run (None for PROFILE_MANY or fewer): the files they add to
    the run's artifacts and the time the profiler adds to each."""
    traces = len(profile.steps) * len(profile.ranks)
    if traces <= PROFILE_MANY:
        return None
    mb = traces * PROFILE_STEP_KB / 1000
    size = f"{mb:.0f} MB" if mb >= 1 else f"{traces * PROFILE_STEP_KB} KB"
    ranks = f"{len(profile.ranks)} rank{'s' if len(profile.ranks) != 1 else ''}"
    return (f"profile.steps asks for {len(profile.steps)} profiled steps on {ranks}: {traces} Chrome traces with their "
            f"tables in the run's artifacts, about {size} or more ({PROFILE_STEP_KB} KB a step for one small layer "
            f"under DDP, more with every op a step runs), and the profiler slows each of those steps. A few steps "
            f"show what a step spends its time on (profile.steps=[10,11,12]).")


def validate(composed: DictConfig, exp_dir: Path | None, schema: Schema) -> ExperimentConfig:
    """Checks the schema cannot express: required keys, ranges, the entry function exists; returns the typed values
    it checked. The required keys are read from the composed tree (a typed value holds no "missing")."""
    if OmegaConf.is_missing(composed, "image"):
        raise ConfigError(
            f"missing required key 'image'. Set it in {EXPERIMENT_FILE} to the container image the experiment "
            "runs in (name:tag or name@sha256:<digest>), or to `image: none` for an experiment that only runs locally."
        )
    if OmegaConf.is_missing(composed, "entry"):
        raise ConfigError(f"missing required key 'entry'. Set it in {EXPERIMENT_FILE}, e.g. entry: train.py:train.")
    check_resolvable(composed)
    cfg = OmegaConf.to_object(composed)
    assert isinstance(cfg, ExperimentConfig), type(cfg)  # compose() builds on Schema.cls
    if cfg.world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {cfg.world_size}.")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"seed must be within [0, 2**63-1] (0 to {MAX_SEED}), got {cfg.seed}.")
    if cfg.seeds is not None:
        check_seeds(list(cfg.seeds))
    for name, value in (("heartbeat_s", cfg.heartbeat_s), ("timeout_s", cfg.timeout_s),
                        ("rendezvous_timeout_s", cfg.rendezvous_timeout_s)):
        if not value > 0:
            raise ConfigError(f"{name} must be > 0 seconds, got {value}.")
    if not cfg.stall_s >= 0:
        raise ConfigError(f"stall_s must be >= 0 seconds (0: off), got {cfg.stall_s}.")
    if not cfg.record.max_untracked_mib >= 0:
        raise ConfigError(f"record.max_untracked_mib must be >= 0, got {cfg.record.max_untracked_mib}.")
    if cfg.threads_per_rank < 1:
        raise ConfigError(f"threads_per_rank must be >= 1, got {cfg.threads_per_rank}.")
    if cfg.fingerprint_every < 1:
        raise ConfigError(f"fingerprint_every must be >= 1, got {cfg.fingerprint_every}.")
    if cfg.checkpoint_every < 0:
        raise ConfigError(f"checkpoint_every must be >= 0 (0 disables), got {cfg.checkpoint_every}.")
    if not cfg.flush_interval_s > 0:  # `not >`: NaN must fail too
        raise ConfigError(f"flush_interval_s must be > 0, got {cfg.flush_interval_s}.")
    check_profile(cfg.profile, cfg.world_size)
    if cfg.determinism.world_size_invariant:
        check_layout(cfg.determinism.shards, cfg.world_size)
    if cfg.backend == Backend.nccl and cfg.device == Device.cpu:
        raise ConfigError("backend nccl needs device cuda (or auto); use backend gloo for cpu.")
    if not cfg.image.strip():
        raise ConfigError(
            "image is empty; pin a container image as name:tag or name@sha256:<digest>, or write `image: none` "
            "for an experiment that only runs locally."
        )
    for backend in schema.backends:  # each backend's own checks (its section, what it needs)
        if backend.check is not None:
            backend.check(cfg)
    for name in ("default", *cfg.replay.tolerance.metrics.keys()):
        tol = cfg.replay.tolerance.default if name == "default" else cfg.replay.tolerance.metrics[name]
        if not (tol.rtol >= 0 and tol.atol >= 0):
            raise ConfigError(f"replay.tolerance '{name}': rtol and atol must be >= 0.")
    match = _ENTRY_RE.match(cfg.entry)
    if not match:
        raise ConfigError(f"entry '{cfg.entry}' must be FILE.py:FUNCTION, e.g. train.py:train.")
    if match["file"].startswith("/") or match["file"].startswith("~"):
        raise ConfigError(
            f"entry '{cfg.entry}' is an absolute path; the entry file must lie in the repository, named relative to "
            "the experiment folder (e.g. entry: train.py:train)."
        )
    if exp_dir is not None:
        check_entry(exp_dir, match["file"], match["func"])
    return cfg


def check_seeds(seeds: list[int]) -> None:
    """A study's seeds: at least one, each a valid seed, none twice (two members would be the same run)."""
    if not seeds:
        raise ConfigError("seeds is an empty list; give at least one seed (e.g. seeds=[0,1,2]) or leave it null.")
    bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
    if bad:
        raise ConfigError(f"seeds must be within [0, 2**63-1] (0 to {MAX_SEED}), got {bad[0]}.")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:
        raise ConfigError(f"seeds lists {', '.join(map(str, twice))} more than once; a study's seeds must be distinct.")


def check_entry(exp_dir: Path, file: str, func: str) -> None:
    """The entry file must exist and define the function (found by parsing, not importing)."""
    import ast

    path = Path(exp_dir) / file
    if not path.is_file():
        raise ConfigError(f"entry file '{path}' does not exist. Fix 'entry' in {EXPERIMENT_FILE}.")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as err:
        raise ConfigError(f"entry file '{path}' has a syntax error at line {err.lineno}: {err.msg}.") from None
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if func not in names:
        found = ", ".join(names) or "none"
        raise ConfigError(f"entry function '{func}' not found in '{path}'. Functions there: {found}.")


def split_entry(entry: str) -> tuple[str, str]:
    match = _ENTRY_RE.match(entry)
    assert match, entry
    return match["file"], match["func"]


def _tree(cfg: DictConfig | ExperimentConfig) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)


def to_yaml(cfg: DictConfig | ExperimentConfig) -> str:
    return OmegaConf.to_yaml(_tree(cfg), resolve=True)


def to_container(cfg: DictConfig | ExperimentConfig) -> dict[str, Any]:
    """The resolved config as plain values (enums as their names): what a secret is looked for in."""
    return OmegaConf.to_container(_tree(cfg), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def from_yaml(text: str, schema: Schema, source: str = "recorded config") -> Experiment:
    """A stored resolved config back into a validated Experiment (replay never reads the folder's YAML)."""
    cfg = compose([(source, OmegaConf.create(text))], schema)
    return Experiment(validate(cfg, None, schema), cfg)


def flatten(cfg: DictConfig | ExperimentConfig | Mapping[str, Any]) -> dict[str, str]:
    """Resolved config (or its plain-dict form) as dotted params, the way MLflow shows them."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping):
            if not node and prefix:
                out[prefix] = "{}"
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(node)

    walk("", to_container(cfg) if isinstance(cfg, (DictConfig, ExperimentConfig)) else cfg)
    return out


def load_module_function(path: Path, func: str) -> Any:
    """Import FILE.py by path and return FUNCTION.

    The module is registered under its file name, with its folder on sys.path, so that objects
    defined there (a Dataset class) pickle by reference into DataLoader worker processes.
    """
    import sys

    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return getattr(module, func)
