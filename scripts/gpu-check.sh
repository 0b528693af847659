#!/usr/bin/env bash
# The checks only a machine with an NVIDIA GPU can make: the CUDA tests, then digits_cnn recorded and
# replayed on cuda (nccl, world size 1, strict determinism) in a throwaway git repo and SQLite store,
# with its step time beside the same run on CPU. Installs nothing from the network; at most
# `pip install -e . --no-deps` when harness itself is not importable. Under 8 minutes.
#
# usage: scripts/gpu-check.sh [WORK_DIR]   (default: a fresh temporary folder, removed afterwards)
# exit:  0 every check passed, 1 a check failed, 2 no GPU visible (nothing was run)
set -uo pipefail

TAG=gpu-check
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [[ "${gpus:-0}" -eq 0 ]]; then
  echo "$TAG: no GPU visible (nvidia-smi lists none); run this on a machine with an NVIDIA GPU." >&2
  exit 2
fi

step() { echo "$TAG: $*"; }
declare -a SUMMARY=()
failed=0
record() {  # record NAME STATUS DETAIL
  SUMMARY+=("$(printf '%-28s %-5s %s' "$1" "$2" "$3")")
  [[ "$2" == ok ]] || failed=1
}

if [[ $# -ge 1 ]]; then
  WORK=$(mkdir -p "$1" && cd "$1" && pwd)
else
  WORK=$(mktemp -d -t harness-gpu-check.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi

cd "$ROOT" || exit 1
if ! "$PY" -c "import harness" 2>/dev/null; then
  step "harness is not importable: pip install -e . --no-deps"
  "$PY" -m pip install -q --no-index --no-deps -e . >"$WORK/pip.log" 2>&1 || {
    echo "$TAG: pip install -e . --no-deps failed, see $WORK/pip.log" >&2; exit 1; }
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "$TAG: $gpus GPU(s) visible, but this torch cannot use CUDA ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1)); install a CUDA build of torch." >&2
  exit 1
fi
step "$(nvidia-smi -L | head -1); torch $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"

# 1. The CUDA tests (their names say cuda; on a CPU-only machine they skip). Skipped here is a failure.
step "CUDA tests: pytest -k cuda"
timeout 120 "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda tests/ >"$WORK/pytest.log" 2>&1
rc=$?
tally=$(tail -1 "$WORK/pytest.log")
if [[ $rc -eq 0 ]] && ! grep -q skipped <<<"$tally"; then
  record "CUDA tests" ok "$tally"
else
  record "CUDA tests" FAIL "exit $rc: $tally (see $WORK/pytest.log)"
  tail -20 "$WORK/pytest.log"
fi

# 2. digits_cnn on cuda, recorded then replayed, in a throwaway repository and store.
PROJECT="$WORK/project"
rm -rf "$PROJECT" "$WORK/store"
mkdir -p "$PROJECT/experiments"
cp -r "$ROOT/experiments/digits_cnn" "$PROJECT/experiments/"
printf 'mlruns/\n__pycache__/\n' >"$PROJECT/.gitignore"
git -C "$PROJECT" init -q -b main
git -C "$PROJECT" add -A
git -C "$PROJECT" -c user.name=gpu-check -c user.email=gpu-check@localhost commit -qm "digits_cnn" || exit 1
export MLFLOW_TRACKING_URI="sqlite:///$WORK/store/mlflow.db"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

harness() {  # harness LOG ARGS...: the run id (last line) on stdout; the exit status kept
  local log=$1
  shift
  (cd "$PROJECT" && timeout 110 "$PY" -m harness "$@") >"$log" 2>&1
  local rc=$?
  tail -1 "$log"
  return $rc
}

CUDA_ARGS=(device=cuda backend=nccl world_size=1 determinism.level=strict)
step "digits_cnn on cuda: ${CUDA_ARGS[*]}"
if cuda_run=$(harness "$WORK/run-cuda.log" run experiments/digits_cnn "${CUDA_ARGS[@]}"); then
  record "run on cuda" ok "$cuda_run"
  step "replay $cuda_run"
  harness "$WORK/replay-cuda.log" replay "$cuda_run" >/dev/null
  rc=$?
  verdict=$(grep '^verdict:' "$WORK/replay-cuda.log" | tail -1)
  if [[ $rc -eq 0 && "$verdict" == "verdict: BITWISE"* ]]; then
    record "replay on cuda" ok "$verdict"
  else
    record "replay on cuda" FAIL "exit $rc: ${verdict:-no verdict} (see $WORK/replay-cuda.log)"
  fi
else
  record "run on cuda" FAIL "see $WORK/run-cuda.log"
  tail -20 "$WORK/run-cuda.log"
fi

# 3. The same run on CPU (gloo), for the step-time ratio.
step "digits_cnn on cpu: device=cpu backend=gloo world_size=1"
if cpu_run=$(harness "$WORK/run-cpu.log" run experiments/digits_cnn device=cpu backend=gloo world_size=1); then
  record "run on cpu" ok "$cpu_run"
else
  record "run on cpu" FAIL "see $WORK/run-cpu.log"
fi
if [[ -n "${cuda_run:-}" && -n "${cpu_run:-}" ]]; then
  ratio=$("$PY" - "$cuda_run" "$cpu_run" <<'EOF'
"""Mean step time of each run from its train_loss timestamps (ms: a GPU step can be shorter), cuda / cpu."""
import sys

from harness.store.tracking import Tracker

tracker = Tracker(writable=False)
times = []
for run_id in sys.argv[1:]:
    stamps = sorted(ts for _, ts, _ in tracker.metric_entries(run_id, "train_loss"))
    times.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan"))
print(f"cuda {times[0]:.2f} ms/step, cpu {times[1]:.2f} ms/step, cuda/cpu {times[0] / times[1]:.2f}x")
EOF
  ) && record "step time" ok "$ratio" || record "step time" FAIL "could not read the runs' step times"
fi

echo
echo "== gpu-check summary =="
printf '%s\n' "${SUMMARY[@]}"
if [[ $failed -ne 0 ]]; then
  echo "gpu-check: FAILED (logs in $WORK)"
  trap - EXIT
  exit 1
fi
echo "gpu-check: all checks passed"
