#!/bin/bash
# The mini bilingual scaling study (docs/studies/mini_bilingual/) on a GPU machine that has neither the data nor
# lm-eval, in four steps. Run every step from the repository root.
#
#   bash launch/gpu/mini_bilingual.sh bundle [DIR]     # here (CPU, lm-eval installed): everything the GPU needs -> DIR
#   bash launch/gpu/mini_bilingual.sh device PART      # on the GPU machine, PART = 1 (LLaMA, TNL), 2 (HGRN2, cos2), all,
#                                                      #   architectures by name (tnl,hgrn2) or runs (tnl-l1d32,cos2-l1d96)
#   bash launch/gpu/mini_bilingual.sh collect DIR...   # here: unpack what came back, report, copy into docs/studies/
#   bash launch/gpu/mini_bilingual.sh sizes [DIR]      # what `bundle` made and what a run would carry
#
# bundle: prepares the corpus (launch/prepare_data.py, shared 2:1 config, dedup on) unless data/shared_2to1 holds it,
#   writes the evaluation inputs (`study.py plan --prepare`: validation windows, lm-eval requests for csr: replay),
#   and packs into DIR (default .gpu/mini_bilingual): data.tar.xz (the token shards: the GPU trains on the very
#   tokens prepared here, and needs no filter or language-id packages), eval_inputs.tar, eval_data.tar.xz (the raw
#   files of the tasks scored there) and the lm-eval wheel (its WikiText detokenizer; the harness is not run there).
# device: installs the carried wheels into /tmp/site, unpacks the bundle (once), trains the part's runs, then exports
#   and evaluates them, each under a deadline, and writes logs, `status` and results_partN.tgz (run configs,
#   metrics.jsonl, summaries, evaluation results and the request file they score, stage records: no weights) to $OUT. The study directory is
#   studies/mini_bilingual under the repository root, outside any carried path, so a second call on the same
#   machine continues it (finished runs and cached evaluations are skipped).
# collect: unpacks results_part*.tgz found under the given folders into the study directory (in the order given: a
#   later tarball's runs replace what an earlier one held of them, files and evaluations alike), writes the report
#   (fits, Table 3, plots, commonsense metrics replayed through lm-eval here) and copies the small files into
#   docs/studies/mini_bilingual/.
#
# Environment: STUDY_CONFIG (another study, default docs/studies/mini_bilingual/study.yaml; its data: is the prepared
# dataset carried, made from DATA_CONFIG if missing), PART_NAME (names the part's log and results files, default PART), BUNDLE (bundle folder, default .gpu/mini_bilingual), WHEELS (folder of wheels to install on the device,
# default .whl), OUT (device output folder), TRAIN_DEADLINE (seconds of training, default 420), DEADLINE (seconds
# from the start of `device` to the end of evaluation, default 540), SIZES (`device` trains only these sizes of the
# part, e.g. "l1d32 l1d48": sizes added to a study whose other runs came back earlier), STUDY_SET
# (space-separated `--set` overrides of the config, e.g. for a dry run: "sizes=[l1d128] tokens=32768", two steps), PYTHON.
set -euo pipefail

CFG=${STUDY_CONFIG:-docs/studies/mini_bilingual/study.yaml}
DATA_CONFIG=${DATA_CONFIG:-launch/configs/data/shared_2to1.yaml}
PY=${PYTHON:-python3}
BUNDLE=${BUNDLE:-.gpu/mini_bilingual}
read -r -a SETS <<< "${STUDY_SET:-}"
SET_ARGS=()
for s in "${SETS[@]}"; do SET_ARGS+=(--set "$s"); done

die() { echo "mini_bilingual.sh: $*" >&2; exit 2; }
# unpack with Python's tarfile: a GPU image may lack the xz program
untar() { $PY -c "import sys, tarfile
t = tarfile.open(sys.argv[1])
t.extractall(sys.argv[2], **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))" "$1" "$2"; }
[ -f "$CFG" ] || die "run me from the repository root (no $CFG here)"

# What the steps need from the config (with the overrides), from one Python process (each one imports torch):
# line 1 the study directory, line 2 its prepared dataset (empty: none), line 3 the shared data folder, line 4
# the raw files of the tasks the GPU machine scores itself (the commonsense tasks are replayed here instead),
# line 5 the runs of PART when one is given: 1 = the first half of the config's architectures, 2 = the rest,
# all = every run, a comma-separated list of architectures (SIZES keeps only those sizes), or a
# comma-separated list of run names
study_query() { $PY - "$CFG" "${1:-}" "${SIZES:-}" "${SETS[@]}" <<'EOF'
import sys
from evaluation.local_data import EVAL_FILES, shared_data_dir
from scaling.study.config import load_study
from scaling.study.plan import plan_study
from scaling.study.stages import TASK_FILES, csr_tasks
study = load_study(sys.argv[1], overrides=sys.argv[4:])
print(study.out)
print(study.data or "")
print(shared_data_dir())
replayed = set(csr_tasks(study)) if study.evaluation.csr == "replay" else set()
print(" ".join("eval/" + EVAL_FILES[f] for t in study.evaluation.tasks if t not in replayed for f in TASK_FILES.get(t, ())))
part = sys.argv[2]
if not part:
    sys.exit(0)
half = (len(study.archs) + 1) // 2
plans = plan_study(study)
runs = [p.name for p in plans]
if part not in ("1", "2", "all") and all(x in runs for x in part.split(",")):
    print(" ".join(x for x in runs if x in part.split(",")))   # single runs by name, in the plan's order
    sys.exit(0)
archs = {"1": study.archs[:half], "2": study.archs[half:], "all": study.archs}.get(part) or part.split(",")
names = [s.name for s in study.sizes]
sizes = sys.argv[3].replace(",", " ").split() or names
for what, asked, known in (("architecture", archs, study.archs), ("size", sizes, names)):
    bad = [x for x in asked if x not in known]
    if bad:
        sys.exit(f"mini_bilingual.sh: {what}(s) {bad} not in the study, which has {known}")
print(" ".join(p.name for p in plans if p.arch in archs and p.size in sizes))
EOF
}
line() { sed -n "$1p" <<< "$2"; }

cmd=${1:-}
shift || true
case "$cmd" in
bundle)
  DIR=${1:-$BUNDLE}
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  mkdir -p "$DIR"
  T0=$(date +%s)
  Q=$(study_query) || die "cannot read the study config $CFG (above)"
  DATA=$(line 2 "$Q")
  [ -n "$DATA" ] || die "the study names no prepared dataset (data:), so there is nothing to carry"
  if [ ! -f "$DATA/train/meta.json" ]; then
    $PY launch/prepare_data.py --config "$DATA_CONFIG" --out "$DATA"
  fi
  STUDY=$(line 1 "$Q")
  $PY launch/study.py plan --config "$CFG" "${SET_ARGS[@]}" --prepare 2>&1 | grep -v "it/s\]\|examples/s\]" || true
  [ -f "$STUDY/eval/valid_tokens.bin" ] || die "no validation windows in $STUDY/eval (plan --prepare failed?)"
  # the loader reads train/, val/ and tokens/; parts/ and merge/ are the prepare step's scratch
  XZ_OPT=-6 tar -C "$(dirname "$DATA")" -cJf "$DIR/data.tar.xz" --exclude=parts --exclude=merge "$(basename "$DATA")"
  tar -C "$STUDY" -cf "$DIR/eval_inputs.tar" $(cd "$STUDY" && ls eval/valid_tokens.bin eval/csr_requests.json 2>/dev/null)
  SHARED=$(line 3 "$Q") FILES=$(line 4 "$Q")
  rm -f "$DIR/eval_data.tar.xz"
  if [ -n "$FILES" ]; then tar -C "$SHARED" -cJf "$DIR/eval_data.tar.xz" $FILES; fi
  if [[ " $FILES " == *wikitext* ]] && ! ls "$DIR"/lm_eval-*.whl >/dev/null 2>&1; then
    V=$($PY -c "import importlib.metadata as m; print(m.version('lm_eval'))")
    $PY -m pip download -q --no-deps "lm-eval==$V" -d "$DIR"
  fi
  echo "bundle written in $(( $(date +%s) - T0 ))s:"
  ls -la "$DIR"
  du -sh "$DIR" .whl 2>/dev/null || true
  ;;

sizes)
  DIR=${1:-$BUNDLE}
  du -sh "$DIR"/* .whl 2>/dev/null
  du -shc "$DIR" .whl 2>/dev/null | tail -1
  ;;

device)
  PART=${1:-}
  [ -n "$PART" ] || die "device needs the part: 1 (the first half of the architectures), 2 (the rest), all, or architectures by name (tnl,hgrn2)"
  : "${OUT:?set OUT to the folder whose files come back}"
  [ -f "$BUNDLE/data.tar.xz" ] || die "no bundle in $BUNDLE: run 'bundle' on the CPU machine and carry $BUNDLE"
  T0=$(date +%s)
  R=$PWD
  S=${SITE:-/tmp/site}
  WHEELS=${WHEELS:-$R/.whl}
  # --no-deps --target: the image has torch, numpy, yaml, ...; lm-eval's files only (perplexity uses its detokenizer)
  WHL=$(ls "$WHEELS"/*.whl "$BUNDLE"/lm_eval-*.whl 2>/dev/null || true)
  if [ -n "$WHL" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$S" $WHL 2>&1 | grep -v "already exists\|WARNING: Target directory" || true
  fi
  export PYTHONPATH=$R:$S PYTHONUNBUFFERED=1
  export LINSCALE_SHARED_DATA=${LINSCALE_SHARED_DATA:-/tmp/mini_bilingual_shared}
  Q=$(study_query "$PART") || die "no runs for part $PART"
  STUDY=$(line 1 "$Q") DATA=$(line 2 "$Q") RUNS=$(line 5 "$Q")
  mkdir -p "$(dirname "$DATA")" "$LINSCALE_SHARED_DATA" "$OUT"
  [ -f "$DATA/train/meta.json" ] || untar "$BUNDLE/data.tar.xz" "$(dirname "$DATA")"
  [ ! -f "$BUNDLE/eval_data.tar.xz" ] || untar "$BUNDLE/eval_data.tar.xz" "$LINSCALE_SHARED_DATA"
  mkdir -p "$STUDY"
  [ -f "$STUDY/eval/valid_tokens.bin" ] || untar "$BUNDLE/eval_inputs.tar" "$STUDY"
  [ -n "$RUNS" ] || die "part $PART${SIZES:+ with sizes $SIZES} holds no runs"
  echo "[gpu] part $PART: $RUNS"
  echo "[gpu] ready in $(( $(date +%s) - T0 ))s; $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null || echo no nvidia-smi)"
  PNAME=${PART_NAME:-${PART//,/-}}   # file names of letters, digits, . _ - (what a device tool brings back)
  LOG=$OUT/part$PNAME.log
  quiet() { grep --line-buffered -v "^step \|it/s\]\|examples/s\]\|snapshot step_\|TNL decay\|layer  *[0-9]*:" || true; }
  set +e
  $PY launch/study.py run --config "$CFG" "${SET_ARGS[@]}" --runs $RUNS --stages train --no-report \
    --deadline "${TRAIN_DEADLINE:-420}" 2>&1 | tee -a "$LOG" | quiet
  echo "[gpu] trained at $(( $(date +%s) - T0 ))s (exit ${PIPESTATUS[0]})"
  LEFT=$(( ${DEADLINE:-540} - ($(date +%s) - T0) ))
  [ "$LEFT" -ge 30 ] || LEFT=30
  $PY launch/study.py run --config "$CFG" "${SET_ARGS[@]}" --runs $RUNS --stages export,evaluate --no-report \
    --deadline "$LEFT" 2>&1 | tee -a "$LOG" | quiet
  echo "[gpu] evaluated at $(( $(date +%s) - T0 ))s (exit ${PIPESTATUS[0]})"
  $PY launch/study.py status --config "$CFG" "${SET_ARGS[@]}" --runs $RUNS 2>&1 | tee "$OUT/status_part$PNAME.txt"
  set -e
  # what the report needs, without weights (metrics, configs, summaries, exports' configs, evaluation, stage records)
  (cd "$STUDY" && tar czf "$OUT/results_part$PNAME.tgz" --exclude='*.bin' --exclude='*.safetensors' --exclude='*.pt' \
    $(for f in eval/csr_requests.json; do [ -e "$f" ] && echo "$f"; done) \
    $(for r in $RUNS; do for f in runs/$r/config.json runs/$r/metrics.jsonl runs/$r/summary.json runs/$r/exports/*/config.json eval/$r state/$r; do
        [ -e "$f" ] && echo "$f"; done; done))
  # resume checkpoints of finished runs are the largest files and no longer needed (snapshots/exports stay)
  for r in $RUNS; do
    if grep -q '"stop": "finished"' "$STUDY/runs/$r/summary.json" 2>/dev/null; then rm -rf "$STUDY/runs/$r/checkpoints"; fi
  done
  ls -la "$OUT"; df -h "$STUDY" | tail -1
  echo "[gpu] part $PART done in $(( $(date +%s) - T0 ))s"
  ;;

collect)
  [ $# -ge 1 ] || die "collect needs the folder(s) holding results_part*.tgz (the device tool's files_at)"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  Q=$(study_query) || die "cannot read the study config $CFG (above)"
  STUDY=$(line 1 "$Q")
  DOCS=$(dirname "$CFG")
  mkdir -p "$STUDY"
  n=0
  for d in "$@"; do
    for t in $(find "$d" -name 'results_part*.tgz' | sort); do
      # a tarball holds the whole record of each of its runs: what an earlier one left of them (another budget's
      # metrics, evaluations of other snapshots) goes, so that two runs' files never mix
      for r in $(tar -tzf "$t" | sed -n 's#^\(runs\|eval\|state\)/\([^/][^/]*\)/.*#\2#p' | sort -u); do
        rm -rf "${STUDY:?}/runs/$r" "$STUDY/eval/$r" "$STUDY/state/$r"
      done
      tar -C "$STUDY" -xzf "$t"; n=$((n + 1)); echo "unpacked $t"
    done
    # the logs without the per-step lines (those are in each run's metrics.jsonl)
    for l in $(find "$d" -name 'part*.log' -o -name 'status_part*.txt'); do
      mkdir -p "$DOCS/logs"; grep -v "^step \|it/s\]\|examples/s\]" "$l" > "$DOCS/logs/$(basename "$l")" || true
    done
  done
  [ "$n" -gt 0 ] || die "no results_part*.tgz under $*"
  $PY launch/study.py report --config "$CFG" "${SET_ARGS[@]}" 2>&1 | { grep -v "it/s\]\|examples/s\]" || true; }
  [ "${PIPESTATUS[0]}" = 0 ] || die "the report failed (above); nothing copied into $DOCS"
  # the study's small files next to its config: runs' metrics and configs, evaluation results, the report
  for r in "$STUDY"/runs/*/; do
    r=$(basename "$r"); rm -rf "${DOCS:?}/runs/$r" "$DOCS/eval/$r"; mkdir -p "$DOCS/runs/$r"
    cp "$STUDY/runs/$r"/{config.json,metrics.jsonl,summary.json} "$DOCS/runs/$r/" 2>/dev/null || true
    [ ! -f "$STUDY/eval/$r/results.json" ] || { mkdir -p "$DOCS/eval/$r"; cp "$STUDY/eval/$r/results.json" "$DOCS/eval/$r/"; }
  done
  cp -r "$STUDY/report/." "$DOCS/"
  echo "copied into $DOCS:"; (cd "$DOCS" && find . -type f | sort | head -80); du -sh "$DOCS"
  ;;

*)
  sed -n 2,30p "$0"
  exit 2
  ;;
esac
