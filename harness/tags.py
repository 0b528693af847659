"""Every tag, param-prefix and artifact name harness writes to MLflow, and the run statuses and kinds, in one place."""

from __future__ import annotations

# MLflow's own tags, so the UI and other tools understand the run.
MLFLOW_GIT_COMMIT = "mlflow.source.git.commit"
MLFLOW_GIT_BRANCH = "mlflow.source.git.branch"
MLFLOW_GIT_REPO_URL = "mlflow.source.git.repoURL"
MLFLOW_SOURCE_NAME = "mlflow.source.name"
MLFLOW_SOURCE_TYPE = "mlflow.source.type"
MLFLOW_PARENT_RUN_ID = "mlflow.parentRunId"
MLFLOW_RUN_NOTE = "mlflow.note.content"
MLFLOW_PREFIX = "mlflow."  # MLflow's namespace: a user's `harness run --tag` may not write into it (nor harness.)
# Experiment tags the UI reads: the experiment's kind, and views shared through `?viewStateShareKey=`.
MLFLOW_EXPERIMENT_KIND = "mlflow.experimentKind"
MLFLOW_SHARED_VIEW_PREFIX = "mlflow.sharedViewState."
# Not a tag but MLflow's name all the same, set by the store and inside ranks: MLflow prints `View run NAME at:
# URL` when a run on a server ends, the URL with the server's user:password.
MLFLOW_SUPPRESS_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"

# MLflow run statuses harness sets and checks.
RUNNING = "RUNNING"
FINISHED = "FINISHED"
FAILED = "FAILED"
KILLED = "KILLED"
# Ended before training did: replay needs --allow-incomplete, resume continues it, `harness mark` closes a stale run as one.
INCOMPLETE = (FAILED, KILLED)
# Not an MLflow status: `harness runs` calls a RUNNING run whose launcher is gone (record/liveness.py) STALE.
STALE = "STALE"
LISTED_STATUSES = (RUNNING, FINISHED, FAILED, KILLED, STALE)  # what `harness runs --status` chooses from

PREFIX = "harness."
# Marks a run as made by harness (replay refuses others); value = harness version.
VERSION = "harness.version"
KIND = "harness.kind"  # one of the KIND_* below
KIND_RUN = "run"
KIND_REPLAY = "replay"
KIND_AUDIT = "audit"
KIND_STUDY = "study"  # the parent of a seed ensemble: its members are ordinary runs (KIND_RUN) nested under it
KIND_STUDY_REPLAY = "study_replay"  # the parent of the replays of a study's members, nested under the study
KIND_VERIFY = "verify"  # `harness verify`: a claims file checked against the record (and replays)
KIND_TRACE = "trace"  # `harness trace`: an op-level trace of one step of a run, nested under it
KIND_BISECT = "bisect"  # `harness bisect GOOD BAD`: the search for the change that flips a result; its probes nest under it
# `harness calibrate RUN_ID`: the rounding envelope of a run's first steps, nested under it; its members (replays
# whose weights were nudged) nest under the run too, tagged CALIBRATION.
KIND_CALIBRATION = "calibration"
KINDS = (KIND_RUN, KIND_REPLAY, KIND_STUDY, KIND_STUDY_REPLAY, KIND_CALIBRATION, KIND_TRACE, KIND_AUDIT, KIND_BISECT,
         KIND_VERIFY)
# UTC ISO 8601 start time: sorts like the start time, as text (sorted by it, the UI lists nested runs as rows too)
STARTED = "harness.started"
EXPERIMENT_PATH = "harness.experiment.path"  # experiment folder relative to the repo root
ENTRY = "harness.entry"

GIT_COMMIT = "harness.git.commit"
GIT_BRANCH = "harness.git.branch"
GIT_DIRTY = "harness.git.dirty"
GIT_REPO_URL = "harness.git.repo_url"
GIT_PATCH_SHA256 = "harness.git.patch_sha256"
GIT_SUBMODULES_SHA256 = "harness.git.submodules_sha256"  # of ARTIFACT_SUBMODULES: each submodule's commit and patch
# `path:line, ...` whose secrets --allow-secret-in-diff cut from the stored patch: it is not the code that ran there.
GIT_PATCH_REDACTED = "harness.git.patch_redacted"

IMAGE = "harness.image"  # as pinned in experiment.yaml
# The registry digest of the image the ranks ran in; HOST where they ran on the host, in no image (the local, slurm
# and torchrun executors); "unknown" in records made before HOST was, whatever ran.
IMAGE_DIGEST = "harness.image.digest"
HOST = "host"
IMAGE_DIGEST_REASON = "harness.image.digest_reason"  # why the pinned image's digest is not known here
IMAGE_ID = "harness.image.id"  # local image id when the engine knows it
# What the pinned tag resolved to when this run started: a host run's pinned image, when this machine's engine knew it.
IMAGE_TAG_DIGEST = "harness.image.tag_digest"
# "id" when a replay ran the local image with the recorded id, the engine knowing no registry digest for it
# (an image loaded from a bundle); the digest tag then repeats the recorded one.
IMAGE_RESOLVED_BY = "harness.image.resolved_by"
IMAGE_NOTE = "harness.image.note"  # plain words on where the job ran relative to its image
EXECUTOR = "harness.executor"  # local | docker | slurm
IN_IMAGE = "harness.in_image"  # true when the job ran inside the pinned image

# Topology: one MLflow run per job, however many nodes it spans.
NNODES = "harness.nnodes"
NPROC_PER_NODE = "harness.nproc_per_node"
LAUNCHER = "harness.launcher"  # spawn | slurm | torchrun: who started the launcher processes
RANK_START = "harness.rank_start"  # forkserver | spawn | torchrun: how this job's rank processes were started
MASTER = "harness.master"  # host:port of node 0's rendezvous store (multi-node only)
NODE_PREFIX = "harness.node."  # harness.node.<R>.<fact>: node R's provenance (node 0's is harness.env.*)
NODES_DIFFER = "harness.nodes.differ"  # "node 1: cpu, torch": nodes whose environments differ from node 0's
SLURM_JOB_ID = "harness.slurm.job_id"
SLURM_NODELIST = "harness.slurm.nodelist"

SEED = "harness.seed"
RANK_SEEDS = "harness.seed.ranks"  # comma-separated, rank order
# The ranks' PYTHONHASHSEED (harness/seeds.py): the order of a set of strings; "random" where nothing pinned it.
HASH_SEED = "harness.seed.hash"
HASH_SEED_SOURCE = "harness.seed.hash.source"  # seed | PYTHONHASHSEED | record | torchrun
WORLD_SIZE = "harness.world_size"
BACKEND = "harness.backend"
DEVICE = "harness.device"
THREADS_PER_RANK = "harness.threads_per_rank"
# Config keys whose "auto" is resolved at launch, and the tag that holds what the ranks ran on. Their params are the
# resolved values, logged once resolved (record/recorder.py), so that MLflow's compare view sees a run and its replay
# (pinned to them) agree; what the experiment asked for stays in config.yaml.
RESOLVED_AT_LAUNCH: dict[str, str] = {"device": DEVICE, "backend": BACKEND}

# Runtime environment, measured where the ranks run (harness.env.<name>).
ENV_PREFIX = "harness.env."
# The device rank 0 trained on, measured inside rank 0 (harness.env.device.<name>: name, capability, sm_count,
# memory; "cpu" and "none" on CPU). harness.env.gpu is the host's GPU list, for information.
DEVICE_PREFIX = "harness.env.device."
# Effective determinism settings read back in rank 0 (harness.determinism.<name>).
DETERMINISM_PREFIX = "harness.determinism."
# What user code changed during training, one determinism.SettingChange line each ("none": nothing); the
# harness.determinism.<name> settings are then the last reading (see determinism.Watch).
DETERMINISM_CHANGES = "harness.determinism.changes"
# NCCL_*, OMP_*, MKL_*, CUBLAS_* ... variables in force (harness.var.<NAME>).
VAR_PREFIX = "harness.var."
# NCCL's configuration files as rank 0 found them (harness.nccl_conf.<file>: "absent" or "<path> sha256:<hex>",
# <file> = system for /etc/nccl.conf, user for $NCCL_CONF_FILE else ~/.nccl.conf), and each KEY=VALUE they set
# (harness.nccl_conf.<file>.<KEY>).
NCCL_CONF_PREFIX = "harness.nccl_conf."

# Declared data (harness/record/data.py): harness.data.<name> = the entry's full sha256 (a folder's over its files).
DATA_PREFIX = "harness.data."
DATA_CHANGES = "harness.replay.data_changes"  # differences accepted with --allow-data-changes, one per line

FINGERPRINT = "harness.fingerprint"
FINGERPRINT_OF = "harness.fingerprint.of"  # what was hashed: model (ctx.ddp) | optimizer (its parameters)
NOTICES = "harness.notices"  # warnings the ranks raised about the record (one per line)
# Metric keys logged by an evaluation (Lightning's validation and test), not by training, as JSON: key -> what its
# steps count. EVAL_AT_STEP: the trainer's step the evaluation ran at; anything else is an index of the key's own
# ("validation batch": Lightning's count of evaluation batches), which no verdict may call a training step.
EVALUATION_METRICS = "harness.metrics.evaluation"
EVAL_AT_STEP = "step"
# What drove the training steps (harness/runtime/boundaries.py): ctx.loader, ctx.steps, own, lightning, accelerate;
# resume and audit read from it why a run has no checkpoint and the way out.
LOOP = "harness.loop"
FAILED_RANK = "harness.failed_rank"
RESUMES = "harness.resumed_from"  # checkpoint steps this run was resumed from, comma-separated
STATUS_REASON = "harness.status_reason"
# The signal that killed the failing rank from outside (SIGKILL: the OOM killer, kill -9): no verdict on its code.
FAILED_SIGNAL = "harness.failed_signal"
# Liveness: the launcher rewrites HEARTBEAT (unix seconds) every HEARTBEAT_S seconds while the job runs;
# a RUNNING run whose heartbeat is older than STALE_FACTOR intervals has lost its launcher.
HEARTBEAT = "harness.heartbeat"
HEARTBEAT_S = "harness.heartbeat_s"
# The process that writes the heartbeat (scratch.process_identity): on its machine, its end is known at once.
HEARTBEAT_BY = "harness.heartbeat.by"
STALE_FACTOR = 3
# "false" when the registered model ended with the weights it started with: nothing was trained.
WEIGHTS_CHANGED = "harness.weights_changed"
INITIAL_FINGERPRINT = "harness.fingerprint.initial"
# Set only when the tracking store was away during the run and its writes were retried (store/outages.py):
# failed write attempts, the most metrics held in memory at once, the longest outage in seconds.
STORE_WRITE_FAILURES = "harness.store.write_failures"
STORE_METRICS_SPOOLED = "harness.store.metrics_spooled"
STORE_LONGEST_OUTAGE_S = "harness.store.longest_outage_s"

# The training code's own calls (harness/runtime/usermlflow.py, harness/runtime/userseed.py).
# Metric keys rank 0 logged through MLflow directly, comma-separated: read back from MLflow's history into the
# run's record (Tracker.load_record), so a replay judges them as it judges ctx.log's values, at their own steps.
USER_MLFLOW_METRICS = "harness.user.mlflow_metrics"
# A param rank 0 logged through MLflow whose name is one of the run's params already (harness's `seed`, ...) with
# another value: kept under this prefix (MLflow refuses to change a param), with a notice.
USER_PARAM_PREFIX = "user."

# What trains the model (harness/runtime/optimization.py), as rank 0 saw it at the counted optimizer's first step.
OPTIMIZER = "harness.optimizer"  # the class ("torch.optim.sgd.SGD"); "none" when no optimizer stepped
# Its param groups' settings without the parameters: "lr=0.1, momentum=0.9, ..." ("group 0: ...; group 1: ...").
OPTIMIZER_SETTINGS = "harness.optimizer.settings"
LR_SCHEDULER = "harness.lr_scheduler"  # "torch.optim.lr_scheduler.StepLR(step_size=1, gamma=0.7, ...)"; or "none"
AUTOCAST = "harness.amp.autocast"  # the autocast regions entered: "cpu bfloat16 from step 0"; or "none"
GRAD_SCALER = "harness.amp.grad_scaler"  # the GradScaler that stepped the optimizer, "disabled", or "none"
# Metrics harness logs itself, at every step of the counted optimizer, beside the training code's: a replay judges
# them as it judges those. A name under this prefix is refused by ctx.log.
OWN_METRIC_PREFIX = "harness."
METRIC_LR = "harness.lr"  # param group 0's learning rate as the step used it; harness.lr.group<i> for group i > 0
METRIC_GRAD_SCALE = "harness.amp.scale"  # the GradScaler's scale the step's loss was multiplied by
# Wall-clock measurements (harness/runtime/perf.py): logged as metrics under this prefix so that the MLflow UI draws
# the step-time curve, and never judged: harness/rundata.py `wall_clock` keeps them out of every verdict (a run's
# record holds them apart, RunRecord.performance). Steps after warm-up, profiled steps left out.
PERF_PREFIX = "harness.perf."
METRIC_STEP_S = "harness.perf.step_s"  # rank 0's wall time of each step, in seconds
METRIC_STEP_S_MAX = "harness.perf.step_s_max"  # the slowest rank's wall time of each step (gathered once at the end)
METRIC_LOADER_WAIT = "harness.perf.loader_wait"  # the share of rank 0's step spent waiting for ctx.loader's batches
METRIC_SAMPLES_PER_S = "harness.perf.samples_per_s"  # every rank's samples in the step over the slowest rank's time
# The run's summary of those, as tags (the UI's run page): median seconds per step over the steps counted (rank 0 and
# the slowest rank), samples per second, the loader-wait share, how many steps were counted and how many skipped.
PERF_STEP_MEDIAN_S = "harness.perf.step_median_s"
PERF_STEP_MAX_MEDIAN_S = "harness.perf.step_max_median_s"
PERF_SAMPLES_PER_S = "harness.perf.samples_per_s_median"
PERF_SAMPLES_PER_STEP = "harness.perf.samples_per_step"
PERF_LOADER_WAIT = "harness.perf.loader_wait_share"
PERF_STEPS = "harness.perf.steps_counted"
# torch.profiler over `profile.steps` (harness/runtime/perf.py): the first profiled step of the first profiled rank,
# summarised; every profiled step's files are artifacts under ARTIFACT_PROFILE_DIR.
PROFILE_PREFIX = "harness.profile."
PROFILE_STEPS = "harness.profile.steps"  # the profiled steps, comma-separated
PROFILE_RANKS = "harness.profile.ranks"
PROFILE_STEP_S = "harness.profile.step_s"  # the profiled step's wall time (profiler overhead included)
# The share of the step's wall time covered by communication events (all-reduce, broadcast, p2p, gloo/nccl work):
# the union of their intervals over the step's window, 0..1.
PROFILE_COMM_SHARE = "harness.profile.comm_share"
PROFILE_PEAK_MEMORY_MB = "harness.profile.peak_memory_mb"  # CUDA: max allocated; CPU: the process's peak RSS
PROFILE_PEAK_MEMORY_OF = "harness.profile.peak_memory_of"  # "cuda allocated" | "cpu peak rss"
# RNG seeds the training code set itself, "train.py:12 torch.manual_seed(1337); ...": the ones harness set are
# harness.seed and harness.seed.ranks.
USER_SEEDS = "harness.user.seeds"
# Accelerate's MLflow tracker (harness/accelerate.py): the config given to init_trackers(config=...), as params
# `accelerate.<key>`, beside the recorded config's own params (`seed`, `world_size`, ...), which MLflow refuses to
# change; its figures and artifacts under this folder of the run's artifacts.
ACCELERATE_PARAM_PREFIX = "accelerate."
ACCELERATE_ARTIFACTS = "accelerate"
TRANSFORMERS_PARAM_PREFIX = "transformers."  # the Trainer's MLflow params (harness/transformers.py)

# Replay / compare.
REPLAY_OF = "harness.replay_of"
VERDICT = "harness.verdict"
# On a BITWISE replay: the metrics that differed where every fingerprint and every other value was bit-identical, so
# not determined by the training (harness/judge/undetermined.py), comma-separated: "mfu,train_runtime".
UNDETERMINED = "harness.verdict.undetermined"
# On an original run: its replays' verdicts counted as `harness runs` counts them ("BITWISE 2, DIVERGED 1 (with
# changes)"), so that its row in the MLflow UI shows them. Rewritten whenever one of its replays is judged, long after
# the run closed: a summary of the replays' own sealed verdicts, and so not sealed itself (record/seal.py).
REPLAYS = "harness.replays"
CONFIG_REDACTED = "harness.config.redacted"  # config keys recorded as <redacted sha256:...>, with =$VAR when read from one
CHANGES = "harness.replay.changes"  # overrides allowed with --allow-changes
# --tolerance METRIC=ATOL[,RTOL] this replay was judged by, over the recorded replay.tolerance: "loss=0.01,0.0 ..."
TOLERANCE = "harness.replay.tolerance"
# replay --steps K: the replay stopped on purpose after its first K optimizer steps (and was judged on them). On the
# replay run, from its creation: the ranks read it from the record (a container or batch job's too).
REPLAY_STEPS = "harness.replay.steps"

# harness calibrate (harness/commands/calibrate.py, harness/judge/rounding.py). On the calibration run: the run it
# calibrates, how many members, how many first steps. On each member (a replay of the run): the calibration it
# belongs to and the seed of its nudge, from its creation (its ranks read it from the record).
CALIBRATION_OF = "harness.calibration_of"
CALIBRATION_MEMBERS = "harness.calibration.members"
CALIBRATION_STEPS = "harness.calibration.steps"
# On the calibration run: the members' nudge, relative to each weight (harness/runtime/perturb.py NUDGE).
CALIBRATION_NUDGE = "harness.calibration.nudge"
CALIBRATION = "harness.calibration"
# A member's CPU kernels besides its nudge (harness/runtime/perturb.py: oneDNN off, another thread count).
CALIBRATION_KERNELS = "harness.calibration.kernels"
PERTURB_SEED = "harness.calibration.perturb_seed"  # 0: the calibration's reference, the run itself re-executed
# On a member, and on a replay of a calibrated run: rank 0 sketched the weights after this many steps (the sketch:
# ARTIFACT_WEIGHTS_SKETCH), from its creation (its ranks read it from the record).
SKETCH_AT = "harness.weights.sketch_at"

# Seed ensembles (harness/commands/study.py). A member run carries STUDY (the study's run id) and is nested under it.
STUDY = "harness.study"
STUDY_SEEDS = "harness.study.seeds"  # on the study: the members' seeds, comma-separated, in member order
STUDY_SIZE = "harness.study.n"  # on the study: how many members
STUDY_PARALLEL = "harness.study.parallel"  # on the study: members run at once
# On the study: "true" when its finished members were bit-identical (metrics and final weights): the code ignores the seed.
STUDY_SEED_IGNORED = "harness.study.seed_ignored"
# On a member's replay made by `harness replay STUDY_ID`: the study replay run it belongs to.
STUDY_REPLAY = "harness.study_replay"
STUDY_MEMBERS_SEED = "harness.study_replay.members_seed"  # on a study replay drawing --members K: the draw's seed

# harness verify: the claims file (path as given) and how many claims held ("2/3").
VERIFY_CLAIMS_FILE = "harness.verify.claims_file"
VERIFY_HELD = "harness.verify.held"
# harness bisect: the two runs it started from, each probe's bisect run, what it found ("commit <sha>", "config
# <key> [<key>...]", or "" when nothing flipped), and how many probes it ran.
BISECT_GOOD = "harness.bisect.good"
BISECT_BAD = "harness.bisect.bad"
BISECT_OF = "harness.bisect.of"
BISECT_CULPRIT = "harness.bisect.culprit"
BISECT_PROBES = "harness.bisect.probes"
BISECT_RESUMED_FROM = "harness.bisect.resumed_from"  # bisect --resume: the bisect whose probes it took up

# The seal (harness/record/seal.py): "v1:<sha256>" of the run's canonical record, written when the run closes.
SEAL = "harness.seal"

# harness import: the run's id in the store it was exported from (a second import of it finds this run).
IMPORTED_FROM = "harness.imported_from"
# "partial" from the import's first write, "complete" as its very last: a run without "complete" is a half import
# (the importer was killed), which the next import deletes and redoes. Imports before this tag existed have none.
IMPORT_STATE = "harness.import.state"
IMPORT_PARTIAL, IMPORT_COMPLETE = "partial", "complete"

AUDIT_OF = "harness.audit_of"
AUDIT_SEGMENTS = "harness.audit.segments"  # drawn segment indices
AUDIT_SEED = "harness.audit.seed"

# harness trace: the run traced, the step, the ranks ("0,1"), the checkpoint step it restarted from
# ("none": from step 0), and whether the re-execution reproduced the run's record up to the step.
TRACE_OF = "harness.trace_of"
TRACE_STEP = "harness.trace.step"
TRACE_RANKS = "harness.trace.ranks"
TRACE_FROM_CHECKPOINT = "harness.trace.from_checkpoint"
TRACE_REPRODUCED = "harness.trace.reproduced"  # true | false | unknown (nothing recorded to hold it to)
TRACE_PURPOSE = "harness.trace.purpose"  # replay --localize: what this trace stands for
LOCALIZED = "harness.localized"  # on a replay: the localization's status (CULPRIT, IDENTICAL, ...)

# Artifacts.
ARTIFACT_CONFIG = "config.yaml"
ARTIFACT_PATCH = "git/uncommitted.patch"  # bytes of `git diff --binary`, never decoded
ARTIFACT_SUBMODULES = "git/submodules.json"  # every checked-out submodule: path, commit, its own exact patch
ARTIFACT_CODE_BUNDLE = "git/code.bundle"  # an imported run's recorded commit as a git bundle (harness import)
ARTIFACT_LOCK = "environment/requirements.lock"
ARTIFACT_NODES = "environment/nodes.json"  # every node's provenance, node rank -> facts
ARTIFACT_DETERMINISM = "environment/determinism.json"  # settings at start and in force, every change in training
ARTIFACT_LOGS_DIR = "logs"
ARTIFACT_FINGERPRINTS = "fingerprints.json"
# {"steps": [...], "digests": [...]}: per step fed by ctx.loader, a digest of the sample indices of every rank's
# batches (messages.DataOrder), so a replay tells a data-pipeline change from a numerical one.
ARTIFACT_DATA_ORDER = "data_order.json"
# The optimizer, LR schedulers, GradScaler and autocast regions in full (runtime/optimization.py: messages.Optimization).
ARTIFACT_OPTIMIZATION = "optimization.json"
DATA_ORDER_STEPS = "harness.data_order.steps"  # how many steps data_order.json holds (absent: none recorded)
ARTIFACT_CHECKPOINTS = "checkpoints"  # step-NNNNNNNN/rank<R>.pt + COMPLETE, in the run's artifacts
# Per checkpoint step: sha256 per tensor (rank 0) and per rank over the set. Outside checkpoints/, so a bundle
# without --with-checkpoints still carries it.
ARTIFACT_CHECKPOINT_FINGERPRINTS = "checkpoint_fingerprints.json"
ARTIFACT_SERIES = "metrics/series.npz"  # every logged value, exact, for fast comparison
ARTIFACT_FAILURE = "failure.txt"
ARTIFACT_DATA_MANIFEST = "data/manifest.json"  # per declared name: paths, per-file size and sha256
ARTIFACT_OUTPUTS_DIR = "outputs"  # what the ranks wrote into ctx.output_dir
ARTIFACT_REPORT = "replay/report.md"
ARTIFACT_PLOTS_DIR = "replay"
ARTIFACT_COMPARISON = "replay/comparison.json"
ARTIFACT_STUDY_SUMMARY = "study/summary.json"  # per metric: the members' final values, their spread, per-step curves
ARTIFACT_STUDY_DIR = "study"  # study/summary.json and study/spread_<metric>.png
ARTIFACT_VERIFY_DIR = "verify"  # verify/report.md, verify/report.html, verify/claims.json
ARTIFACT_AUDIT = "audit/report.md"
ARTIFACT_AUDIT_JSON = "audit/segments.json"
ARTIFACT_TRACE_DIR = "trace"  # trace/rank<R>.jsonl.gz (optrace.dumps) and trace/meta.json
ARTIFACT_TRACE_META = "trace/meta.json"
ARTIFACT_LOCALIZATION = "replay/localization.md"
ARTIFACT_LOCALIZATION_HTML = "replay/localization.html"
ARTIFACT_ENVELOPE = "calibration/envelope.json"  # the rounding envelope (harness/judge/rounding.py Envelope)
# The weights after SKETCH_AT steps, folded small (harness/runtime/sketch.py; read by harness/judge/weightdistance.py):
# on a member or a replay; on the calibration run, its reference's (the run's own weights after the M steps).
ARTIFACT_WEIGHTS_SKETCH = "weights/sketch.npz"
ARTIFACT_PROFILE_DIR = "profile"  # rank<R>-step<K>.trace.json (Chrome trace), .table.txt, .summary.json
ARTIFACT_SEAL = "seal/manifest.json"  # the canonical record harness.seal is the sha256 of

# Harness's own bookkeeping: tags that say what harness did with a run - which run it replays, audits, traces or
# calibrates, which study, calibration or bisect it belongs to, what it asked the ranks to do besides training (stop
# after K steps, sketch the weights: runtime/plan.py Steering), how it was judged, sealed or imported - never the
# conditions it ran under. A replay differs from its original in them by construction, so no environment delta
# lists them (harness/judge/delta.py). CALIBRATION_KERNELS and PERTURB_SEED are not among them: a member's other
# kernels and nudged weights change its arithmetic.
BOOKKEEPING: frozenset[str] = frozenset({
    KIND, REPLAY_OF, VERDICT, UNDETERMINED, REPLAYS, CHANGES, TOLERANCE, REPLAY_STEPS, DATA_CHANGES, LOCALIZED,
    CALIBRATION_OF, CALIBRATION_MEMBERS, CALIBRATION_STEPS, CALIBRATION_NUDGE, CALIBRATION, SKETCH_AT,
    STUDY, STUDY_SEEDS, STUDY_SIZE, STUDY_PARALLEL, STUDY_SEED_IGNORED, STUDY_REPLAY, STUDY_MEMBERS_SEED,
    VERIFY_CLAIMS_FILE, VERIFY_HELD,
    BISECT_GOOD, BISECT_BAD, BISECT_OF, BISECT_CULPRIT, BISECT_PROBES, BISECT_RESUMED_FROM,
    AUDIT_OF, AUDIT_SEGMENTS, AUDIT_SEED,
    TRACE_OF, TRACE_STEP, TRACE_RANKS, TRACE_FROM_CHECKPOINT, TRACE_REPRODUCED, TRACE_PURPOSE,
    SEAL, IMPORTED_FROM, IMPORT_STATE,
})
