#!/usr/bin/env bash
# The checks only a machine with an NVIDIA GPU can make, as one command that also runs where nothing can be
# fetched: it installs the carried wheels, checks git and every import for real, then
#   stage 1  torch-only probes of strict determinism (scripts/gpu_probes.py: fresh processes give identical
#            bytes, `off` as the negative control, the refused ops, TF32 really off, digests, RNG round trips),
#            then the tests that need a GPU (pytest -k cuda);
#   stage 2  harness itself on cuda/nccl in a throwaway git repo and SQLite store: digits_cnn run + replay
#            BITWISE, the recorded determinism tags, a calibrated run with nondeterministic kernels (off) whose
#            plain replays are WITHIN_ROUNDING and whose lr x1.02 replay is DIVERGED by step 2, the kept rank
#            server's preload never initialising CUDA, world-size-invariant mode twice, a crash + resume equal to
#            the uninterrupted run, a TF32 change localised to its matmul and the precision rule, and the
#            strict-vs-off step time;
#   stage 3  (two GPUs or more, else one line saying it was skipped) a 2-rank DDP replay, invariant mode 1 vs 2
#            ranks with a 64 MiB gradient under a short timeout, FSDP2 run + replay BITWISE + a killed rank resumed,
#            repeated all-reduces with NVLS off and on.
# It writes OUT_DIR/summary.txt and OUT_DIR/gpu-check-logs.tar.gz (two files) and prints the table last.
# Every stage runs under `timeout`; the whole check stays under 8 minutes.
#
# On the device machine (one H200, CUDA torch 2.11 under Python 3.12, no MLflow, OmegaConf or GitPython):
#   here, once:  python scripts/gpu_wheels.py          (cp312 wheels into the ignored .whl/, about 22 MiB)
#   there:       run  command="bash scripts/gpu-check.sh $OUT"  carry=[".whl"]  timeout_s=540
#
# usage: scripts/gpu-check.sh [OUT_DIR]   (default: a new temporary folder, printed)
# exit:  0 every check passed, 1 a check failed, 2 no GPU visible (nothing run, nothing written)
# GPU_CHECK_DEVICE=cpu runs the same stages on CPU/gloo, to try the script itself without a GPU: its verdicts are
# not a GPU's (the TF32 change cannot show there), it installs nothing (GPU_CHECK_INSTALL=1 to install anyway),
# and GPU_CHECK_BUDGET_S (default 450) may need raising on a small machine.
set -uo pipefail

TAG=gpu-check
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
# The CPU dry run installs nothing by default: on a development machine pip would re-point its own harness.
INSTALL=${GPU_CHECK_INSTALL:-$([[ "$DEVICE" == cuda ]] && echo 1 || echo 0)}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}  # the stages stop starting checks after this; the rest is packing up

if [[ "$DEVICE" == cuda ]]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  if [[ "${gpus:-0}" -eq 0 ]]; then
    echo "$TAG: no GPU visible (nvidia-smi lists none); run this on a machine with an NVIDIA GPU." >&2
    exit 2
  fi
else
  gpus=0
fi

if [[ $# -ge 1 ]]; then OUT=$1; else OUT=$(mktemp -d -t gpu-check-out.XXXXXX); fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
WORK=$(mktemp -d -t harness-gpu-check.XXXXXX)
LOGS="$WORK/logs"
mkdir -p "$LOGS"
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS

step() { echo "$TAG: $*"; }
declare -a SUMMARY=()
failed=0
checks=0
record() {  # record NAME STATUS DETAIL  (STATUS ok | FAIL | info | skip)
  SUMMARY+=("$(printf '%-30s %-5s %s' "$1" "$2" "$3")")
  [[ "$2" == info || "$2" == skip ]] || checks=$((checks + 1))
  [[ "$2" == ok || "$2" == info || "$2" == skip ]] || failed=$((failed + 1))
}
left() { echo $((BUDGET_S - (SECONDS - start))); }
in_time() {  # in_time NAME: false (and NAME recorded as FAIL) once the budget is spent
  if [[ $(left) -le 20 ]]; then record "$1" FAIL "not started: the 8-minute budget is spent"; return 1; fi
}
deadline() {  # deadline WANT: WANT seconds, or what is left of the budget if less
  local l
  l=$(left)
  echo $((l < $1 ? (l > 10 ? l : 10) : $1))
}

finish() {
  {
    echo "== gpu-check summary =="
    echo "host: $(hostname); $(nvidia-smi -L 2>/dev/null | head -1 || echo 'no nvidia-smi')"
    echo "torch: ${TORCH_LINE:-?}; device=$DEVICE; $((SECONDS - start)) s"
    printf '%s\n' "${SUMMARY[@]}"
    if [[ $failed -ne 0 ]]; then
      echo "gpu-check: FAILED: $failed of $checks checks (logs in gpu-check-logs.tar.gz)"
    else
      echo "gpu-check: all $checks checks passed"
    fi
  } >"$OUT/summary.txt"
  [[ -f "$WORK/store/mlflow.db" ]] && cp "$WORK/store/mlflow.db" "$LOGS/" 2>/dev/null
  tar -czf "$OUT/gpu-check-logs.tar.gz" -C "$WORK" logs 2>/dev/null
  echo
  cat "$OUT/summary.txt"
  echo "($OUT: summary.txt, gpu-check-logs.tar.gz)"
  [[ $failed -eq 0 ]] && exit 0 || exit 1
}

cd "$ROOT" || exit 1
nvidia-smi >"$LOGS/nvidia-smi.txt" 2>&1

# -- install: the carried wheels, then harness itself without its dependencies --------------------------------
if [[ "$INSTALL" != 1 ]]; then
  record "install" info "GPU_CHECK_INSTALL=0: nothing installed, harness from PYTHONPATH=$ROOT"
elif [[ -f "$ROOT/.whl/requirements.txt" ]]; then
  step "installing $(ls "$ROOT"/.whl/*.whl | wc -l) carried wheels"
  if timeout 180 "$PY" -m pip install --no-index --find-links "$ROOT/.whl" -r "$ROOT/.whl/requirements.txt" \
      >"$LOGS/install.log" 2>&1; then
    record "install.wheels" ok "$(grep -c . "$ROOT/.whl/requirements.txt") requirements from .whl/"
  else
    record "install.wheels" FAIL "pip install from .whl/ failed: $(grep -m1 -E 'ERROR|No matching' "$LOGS/install.log")"
  fi
else
  record "install.wheels" info "no .whl/ here (python scripts/gpu_wheels.py makes it): using what is installed"
fi
# --no-build-isolation: the isolated build would fetch setuptools from an index.
if [[ "$INSTALL" != 1 ]]; then
  :
elif timeout 120 "$PY" -m pip install --no-index --no-deps --no-build-isolation -e "$ROOT" >>"$LOGS/install.log" 2>&1; then
  record "install.harness" ok "pip install --no-deps -e ."
else
  record "install.harness" info "pip install -e . failed: harness runs from PYTHONPATH=$ROOT"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# -- every import for real, git, and CUDA -------------------------------------------------------------------
if git_version=$(git --version 2>&1); then record "git" ok "$git_version"; else record "git" FAIL "no git: $git_version"; fi
if timeout 120 "$PY" - "$DEVICE" >"$LOGS/imports.log" 2>&1 <<'EOF'
"""Import what the harness commands import (not only `import harness`, which loads nothing), then ask for CUDA."""
import importlib
import sys

for name in ("harness.cli.main", "harness.commands.api", "harness.runtime.context", "mlflow", "mlflow.tracking",
             "mlflow.store.tracking.sqlalchemy_store", "omegaconf", "git", "click", "sqlalchemy", "alembic",
             "numpy", "scipy", "sklearn", "tqdm", "psutil", "matplotlib", "torch"):
    importlib.import_module(name)
import git
import torch

git.Repo  # GitPython loads its git binary lazily: ask it now
print(f"torch {torch.__version__} cuda {torch.version.cuda} cudnn {torch.backends.cudnn.version()}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("torch.cuda.is_available() is False")
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF
then
  TORCH_LINE=$(paste -sd';' "$LOGS/imports.log")
  record "imports" ok "$TORCH_LINE"
else
  record "imports" FAIL "$(tail -1 "$LOGS/imports.log")"
  finish  # nothing below can run
fi

# -- stage 1: probes, torch alone ------------------------------------------------------------------------------
probe_args=()
[[ "$DEVICE" == cpu ]] && probe_args=(--cpu)
step "stage 1: probes (scripts/gpu_probes.py ${probe_args[*]})"
timeout "$(deadline 180)" "$PY" scripts/gpu_probes.py "${probe_args[@]}" --json "$LOGS/probes.json" >"$LOGS/stage1.log" 2>&1
rc=$?
probes_ok=$(grep -c '^probe [^ ]* ok ' "$LOGS/stage1.log")
probes_failed=$(grep '^probe [^ ]* FAIL ' "$LOGS/stage1.log" | cut -d' ' -f2 | paste -sd, -)
off_differs=$(grep '^probe off\.[^ ]* info differs' "$LOGS/stage1.log" | cut -d' ' -f2 | sed 's/^off\.//' | paste -sd, -)
refused=$(grep '^probe strict\.refuses\.[^ ]* ok raised' "$LOGS/stage1.log" | cut -d' ' -f2 | sed 's/^strict\.refuses\.//' | paste -sd, -)
tf32=$(grep '^probe tf32_' "$LOGS/stage1.log" | awk '{print $2 "=" $(NF-2)}' | paste -sd' ' -)
if [[ $rc -eq 0 ]]; then
  record "stage1.probes" ok "$probes_ok probes ok"
else
  record "stage1.probes" FAIL "exit $rc; failed: ${probes_failed:-$(tail -1 "$LOGS/stage1.log")}"
fi
record "stage1.strict_refuses" info "${refused:-none raised}"
record "stage1.off_differs" info "${off_differs:-none differed between two processes}"
record "stage1.tf32_errors" info "${tf32:-?}"

# The tests that need a GPU (their names say cuda; on a CPU-only machine they skip, so a skip here is a failure).
if [[ "$DEVICE" != cuda ]]; then
  record "stage1.cuda_tests" skip "no GPU: pytest -k cuda would only skip"
elif in_time stage1.cuda_tests; then
  # Only the modules that hold such tests are collected: the others import what this machine need not have
  # (psycopg2, a browser's driver...).
  mapfile -t cuda_modules < <(grep -l 'def test[a-z0-9_]*cuda' tests/test_*.py)
  timeout "$(deadline 120)" "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda "${cuda_modules[@]}" \
    >"$LOGS/cuda-tests.log" 2>&1
  rc=$?
  tally=$(grep -E '(passed|failed|skipped|error|no tests ran)' "$LOGS/cuda-tests.log" | tail -1)
  if [[ $rc -eq 0 ]] && ! grep -q skipped <<<"$tally"; then
    record "stage1.cuda_tests" ok "pytest -k cuda: $tally"
  else
    record "stage1.cuda_tests" FAIL "pytest -k cuda exit $rc: ${tally:-see logs/cuda-tests.log}"
  fi
fi

# -- stage 2: harness itself, in a throwaway repository and store ------------------------------------------------
PROJECT="$WORK/project"
mkdir -p "$PROJECT/experiments" "$WORK/store"
cp -r "$ROOT/experiments/digits_cnn" "$ROOT/scripts/gpu_check/tf32_matmul" "$ROOT/scripts/gpu_check/big_grad" "$ROOT/scripts/gpu_check/fsdp_mlp" \
  "$PROJECT/experiments/"
# A crash for the resume check: rank 0 kills itself at step KILL_AT (unset: no crash, the same code otherwise).
"$PY" - "$PROJECT/experiments/digits_cnn/train.py" <<'EOF' || record "setup.kill_hook" FAIL "train.py changed shape"
import sys
from pathlib import Path

path = Path(sys.argv[1])
text = path.read_text()
after = '            ctx.log({"train_loss": loss}, ctx.step)\n'
hook = ('            if ctx.rank == 0 and ctx.step == int(os.environ.get("KILL_AT", "-1")):\n'
        '                os.kill(os.getpid(), signal.SIGKILL)  # a real crash: no cleanup\n')
assert after in text, "the train_loss line moved"
path.write_text("import os\nimport signal\n" + text.replace(after, after + hook, 1))
EOF
printf 'mlruns/\n__pycache__/\n' >"$PROJECT/.gitignore"
git -C "$PROJECT" init -q -b main
git -C "$PROJECT" add -A
git -C "$PROJECT" -c user.name=gpu-check -c user.email=gpu-check@localhost commit -qm "gpu-check experiments" \
  || record "setup.git" FAIL "could not commit the experiments"
export MLFLOW_TRACKING_URI="sqlite:///$WORK/store/mlflow.db"

# Each harness command's output is logs/NAME.out and logs/NAME.err (the calls below often run in a subshell, $(...),
# so the helpers take NAME rather than remembering the last call).
harness() {  # harness NAME ARGS...: runs `harness ARGS` in the project; the run id (stdout's last line) on stdout
  local name=$1
  shift
  (cd "$PROJECT" && timeout "$(deadline "${CMD_S:-150}")" "$PY" -m harness "$@") >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  local rc=$?
  tail -1 "$LOGS/$name.out"
  return $rc
}
verdict() { grep -m1 '^verdict:' "$LOGS/$1.out"; }  # verdict NAME
failure() {  # failure NAME RC: one line on why the command NAME failed
  echo "exit $2; $(grep -m1 -E '^(Error|Warning)' "$LOGS/$1.err" || tail -1 "$LOGS/$1.err") (logs/$1.err)"
}

if [[ "$DEVICE" == cuda ]]; then ON=(device=cuda backend=nccl); else ON=(device=cpu backend=gloo); fi
DIGITS=(experiments/digits_cnn "${ON[@]}" world_size=1 train.epochs=2 checkpoint_every=30)  # 90 steps
step "stage 2: harness on ${ON[*]}"

strict_run=""
if in_time run.digits; then
  if strict_run=$(harness run-digits run "${DIGITS[@]}"); then
    record "run.digits" ok "$strict_run"
  else
    record "run.digits" FAIL "$(failure run-digits $?)"
    strict_run=""
  fi
fi
if [[ -n "$strict_run" ]] && in_time replay.digits; then
  harness replay-digits replay "$strict_run" >/dev/null
  rc=$?
  v=$(verdict replay-digits)
  if [[ $rc -eq 0 && "$v" == "verdict: BITWISE"* ]]; then record "replay.digits" ok "$v"; else record "replay.digits" FAIL "${v:-$(failure replay-digits $rc)}"; fi
  tags=$(timeout 60 "$PY" scripts/gpu_check/runs.py tags "$strict_run" 2>&1)
  if [[ $? -eq 0 ]]; then record "tags.determinism" ok "$tags"; else record "tags.determinism" FAIL "$tags"; fi
fi

# The rounding envelope on a GPU (harness calibrate, WITHIN_ROUNDING). With determinism.level=off the kernels may be
# nondeterministic, so the envelope must also hold the machine's own run-to-run variation: two plain replays of the
# calibrated run are BITWISE or WITHIN_ROUNDING, `drift` prints how far they landed beside the envelope's width, and
# lr x1.02 is DIVERGED against it by step 2. The members fork from a kept rank server, which must never touch CUDA.
if in_time calibrate.off; then
  export HARNESS_RANK_SERVER_IDLE_S=120
  OFF1=(experiments/digits_cnn "${ON[@]}" world_size=1 train.epochs=1 "determinism.level='off'")  # 45 steps
  if ! cal_run=$(harness run-cal run "${OFF1[@]}"); then
    record "calibrate.off" FAIL "run: $(failure run-cal $?)"
  elif ! CMD_S=300 harness calibrate calibrate "$cal_run" --members 6 --steps 45 >/dev/null; then
    record "calibrate.off" FAIL "calibrate: $(failure calibrate $?)"
  else
    record "calibrate.off" ok "$(grep -h -m1 -oE 'the members. largest distance.*' "$LOGS/calibrate.out" "$LOGS/calibrate.err" | head -1)"
    replays=()
    for i in 1 2; do
      rid=$(harness "replay-off-$i" replay "$cal_run")
      rc=$?
      v=$(verdict "replay-off-$i")
      if [[ $rc -eq 0 && ( "$v" == "verdict: BITWISE"* || "$v" == "verdict: WITHIN_ROUNDING"* ) ]]; then
        record "calibrate.replay$i" ok "${v:0:220}"
        replays+=("$rid")
      else
        record "calibrate.replay$i" FAIL "${v:-$(failure "replay-off-$i" $rc)}"
      fi
    done
    if [[ ${#replays[@]} -gt 0 ]]; then
      d=$(timeout 60 "$PY" scripts/gpu_check/runs.py drift "$cal_run" "${replays[@]}" 2>&1)
      record "calibrate.drift" info "$d"
    fi
    harness replay-lr replay "$cal_run" --allow-changes train.lr=0.051 >/dev/null
    rc=$?
    v=$(verdict replay-lr)
    at=$(grep -m1 -oE 'DIVERGED at step [0-9]+' <<<"$v" | grep -oE '[0-9]+$')
    if [[ $rc -eq 1 && -n "$at" && "$at" -le 2 ]]; then record "calibrate.lr_x1.02" ok "${v:0:300}"
    else record "calibrate.lr_x1.02" FAIL "exit $rc: ${v:-$(failure replay-lr $rc)}"; fi
  fi
  # The kept server that forked those ranks. What CUDA cannot survive is a fork after the driver was initialised
  # (cuInit); a mapped libcuda alone is harmless (measured on an H200: `import torch` 2.11+cu130 maps it, calls no
  # cuInit, and a fork of it uses the GPU).
  # scripts/gpu_check/preload.py replays the server's preload import by import, asks the driver whether it was
  # initialised, and forks a child that must use the GPU; the live server's maps are reported beside it.
  server_pids=$("$PY" -c 'import json; from harness.executors import rankserver as r
[print(json.loads(f.read_text())["server"]) for f in r.root().glob("*/state.json")]' 2>/dev/null)
  mapped=""
  for pid in $server_pids; do
    grep -q 'libcuda\.so' "/proc/$pid/maps" 2>/dev/null && mapped+=" $pid:libcuda"
    ls -l "/proc/$pid/fd" 2>/dev/null | grep -q '/dev/nvidia' && mapped+=" $pid:/dev/nvidia-open"
  done
  line=$(timeout 120 "$PY" scripts/gpu_check/preload.py 2>&1)
  rc=$?
  if [[ "$DEVICE" != cuda ]]; then
    record "rankserver.no_cuda" info "no GPU: $line; live server(s) ${server_pids:-none}"
  elif [[ -z "$server_pids" ]]; then
    record "rankserver.no_cuda" FAIL "no kept rank server found (harness/executors/rankserver.py root()); preload: $line"
  elif [[ $rc -eq 0 ]]; then
    record "rankserver.no_cuda" ok "$line; live server(s) $server_pids:${mapped:- nothing of CUDA mapped}"
  else
    record "rankserver.no_cuda" FAIL "$line; live server(s) $server_pids:${mapped:- nothing of CUDA mapped}"
  fi
  "$PY" -c 'from harness.executors import rankserver; rankserver.stop_all()' >/dev/null 2>&1
  unset HARNESS_RANK_SERVER_IDLE_S
fi

if in_time invariant.twice; then
  inv=()
  for i in 1 2; do
    if id=$(harness "run-invariant-$i" run "${DIGITS[@]}" determinism.world_size_invariant=true determinism.shards=4); then
      inv+=("$id")
    else
      record "invariant.twice" FAIL "run $i: $(failure "run-invariant-$i" $?)"
      break
    fi
  done
  if [[ ${#inv[@]} -eq 2 ]]; then
    harness compare-invariant compare "${inv[@]}" >/dev/null
    rc=$?
    v=$(verdict compare-invariant)
    if [[ "$v" == "verdict: BITWISE"* ]]; then record "invariant.twice" ok "$v"; else record "invariant.twice" FAIL "${v:-$(failure compare-invariant $rc)}"; fi
  fi
fi

if [[ -n "$strict_run" ]] && in_time resume.bit_exact; then
  crashed=$(KILL_AT=50 harness run-crash run "${DIGITS[@]}")
  rc=$?
  if [[ $rc -ne 1 || -z "$crashed" ]]; then
    record "resume.bit_exact" FAIL "the crash run did not fail as planted: $(failure run-crash $rc)"
  elif ! harness resume resume "$crashed" >/dev/null; then
    record "resume.bit_exact" FAIL "resume: $(failure resume $?)"
  elif ! grep -q "Proved: steps" "$LOGS/resume.err"; then
    record "resume.bit_exact" FAIL "resume did not prove the segment before its checkpoint (logs/resume.err)"
  else
    harness compare-resumed compare "$crashed" "$strict_run" >/dev/null
    v=$(verdict compare-resumed)
    if [[ "$v" == "verdict: BITWISE"* ]]; then
      record "resume.bit_exact" ok "killed at step 50, resumed from 30; vs uninterrupted: $v"
    else
      record "resume.bit_exact" FAIL "resumed vs uninterrupted: ${v:-$(failure compare-resumed 1)}"
    fi
  fi
fi

if in_time trace.tf32; then
  if tf32_run=$(harness run-tf32 run experiments/tf32_matmul "${ON[@]}"); then
    harness replay-tf32 replay "$tf32_run" --allow-changes train.tf32=true --localize >/dev/null
    found=$(sed -n '/Localization of step/,$p' "$LOGS/replay-tf32.out")
    op=$(grep -m1 -oE 'op: aten\.[a-z_]+' <<<"$found")
    if [[ "$(verdict replay-tf32)" == "verdict: DIVERGED"* ]] && grep -q CULPRIT <<<"$found" \
        && grep -qE 'op: aten\.(mm|addmm|linear|matmul)' <<<"$found" && grep -q "a precision setting differs" <<<"$found"; then
      record "trace.tf32" ok "${op#op: } CULPRIT; $(grep -m1 -oE 'float32_matmul_precision [^,;]*' <<<"$found")"
    else
      record "trace.tf32" FAIL "$(verdict replay-tf32 || echo 'no verdict'); ${op:-no culprit op}; $(grep -m1 'likely cause' <<<"$found" || echo 'no precision rule') (logs/replay-tf32.out)"
    fi
  else
    record "trace.tf32" FAIL "run: $(failure run-tf32 $?)"
  fi
fi

if [[ -n "$strict_run" ]] && in_time steptime.strict_vs_off; then
  # Quoted for the override parser (YAML): a bare `off` is read as the boolean false and refused.
  if off_run=$(harness run-off run "${DIGITS[@]}" "determinism.level='off'"); then
    t=$(timeout 60 "$PY" scripts/gpu_check/runs.py steptime "$strict_run" "$off_run" 2>&1)
    if [[ $? -eq 0 ]]; then record "steptime.strict_vs_off" ok "$t"; else record "steptime.strict_vs_off" FAIL "$t"; fi
  else
    record "steptime.strict_vs_off" FAIL "run with determinism.level=off: $(failure run-off $?)"
  fi
fi

# -- stage 3: two GPUs or more ------------------------------------------------------------------------------
if [[ $gpus -lt 2 ]]; then
  record "stage3" skip "$gpus GPU visible: the 2-rank DDP replay, invariant 1 vs 2 ranks and NVLS checks need two"
else
  step "stage 3: $gpus GPUs"
  if in_time ddp2.replay; then
    if ddp=$(harness run-ddp2 run experiments/digits_cnn "${ON[@]}" world_size=2 train.epochs=2); then
      harness replay-ddp2 replay "$ddp" >/dev/null
      rc=$?
      v=$(verdict replay-ddp2)
      if [[ "$v" == "verdict: BITWISE"* ]]; then record "ddp2.replay" ok "$v"; else record "ddp2.replay" FAIL "${v:-$(failure replay-ddp2 $rc)}"; fi
    else
      record "ddp2.replay" FAIL "run: $(failure run-ddp2 $?)"
    fi
  fi
  if in_time invariant.64MiB; then
    # big_grad's timeout_s (90 s) ends a send/recv deadlock; `timeout` ends the command if that fails too.
    if big=$(harness run-big-grad run experiments/big_grad "${ON[@]}" world_size=2); then
      harness replay-big-grad replay "$big" --world-size 1 >/dev/null
      rc=$?
      v=$(verdict replay-big-grad)
      if [[ "$v" == "verdict: BITWISE"* ]]; then record "invariant.64MiB" ok "2 ranks replayed on 1: $v"; else record "invariant.64MiB" FAIL "${v:-$(failure replay-big-grad $rc)}"; fi
    else
      record "invariant.64MiB" FAIL "2 ranks: $(failure run-big-grad $?) (a hang ends at timeout_s=90)"
    fi
  fi
  if in_time fsdp2.resume; then
    # FSDP2 on nccl: the shards' digests, DCP checkpoints and the replica check over replicated parameters only.
    if fsdp=$(harness run-fsdp run experiments/fsdp_mlp "${ON[@]}"); then
      harness replay-fsdp replay "$fsdp" >/dev/null
      v=$(verdict replay-fsdp)
      if [[ "$v" == "verdict: BITWISE"* ]]; then record "fsdp2.replay" ok "$v"; else record "fsdp2.replay" FAIL "${v:-$(failure replay-fsdp $?)}"; fi
      killed=$(KILL_AT=7 harness run-fsdp-kill run experiments/fsdp_mlp "${ON[@]}")
      if [[ -z "$killed" ]]; then
        record "fsdp2.resume" FAIL "the crash run left no run id: $(failure run-fsdp-kill 1)"
      elif ! harness resume-fsdp resume "$killed" >/dev/null; then
        record "fsdp2.resume" FAIL "resume: $(failure resume-fsdp $?)"
      else
        harness compare-fsdp compare "$killed" "$fsdp" >/dev/null
        v=$(verdict compare-fsdp)
        if [[ "$v" == "verdict: BITWISE"* ]]; then record "fsdp2.resume" ok "killed at step 7, resumed; vs uninterrupted: $v"; else record "fsdp2.resume" FAIL "${v:-$(failure compare-fsdp $?)}"; fi
      fi
    else
      record "fsdp2.replay" FAIL "run: $(failure run-fsdp $?)"
    fi
  fi
  for nvls in 0 1; do
    if in_time "allreduce.nvls$nvls"; then
      line=$(NCCL_NVLS_ENABLE=$nvls timeout "$(deadline 120)" "$PY" scripts/gpu_probes.py allreduce "${probe_args[@]}" 2>"$LOGS/allreduce-nvls$nvls.err")
      rc=$?
      if [[ $rc -eq 0 ]]; then record "allreduce.nvls$nvls" ok "$line"
      elif [[ $nvls -eq 1 && $rc -eq 1 ]]; then record "allreduce.nvls$nvls" info "$line (NVLS is documented as not deterministic)"
      else record "allreduce.nvls$nvls" FAIL "exit $rc: ${line:-$(tail -1 "$LOGS/allreduce-nvls$nvls.err")}"
      fi
    fi
  done
fi

finish
