#!/usr/bin/env bash
# One lease of a lent GPU (the workplace's `device` tool): set up, then run the named jobs in order, each in its own
# process under a time limit, so that one failure or overrun costs only its own job. $OUT gets log.txt and
# results.tgz (every JSON written so far, rewritten after each job, so an overrun still returns what finished).
#
#   bash benchmarks/gpu_lease.sh 'train:model=r50 batch=128' 'torch:r50 128' 'torch:r50 128 8000000 --compile' ...
#
# Job forms: `train:KEY=VALUE ... [--set KEY=VALUE ...]` (benchmarks/step_throughput.py --only each pair, other
# arguments as they are), `torch:NETWORK BATCH [CLASSES] [ARGS]` (arcface_torch's step from .gpudata/bench: PartialFC
# 0.1 with fp16 as train_v2.py runs it, CLASSES default 1000000, ARGS e.g. --compile or --max-classes), `py:SCRIPT
# ARGS` (a script of benchmarks/, its --out in the results), `sh:COMMAND` ($RESULTS is the results folder). A job
# written `|JOB` runs only if the job before it failed (a fallback); one ending in ` @SECONDS` runs under that time
# limit instead of JOB_LIMIT (e.g. arcface_torch's --max-classes bisection, which builds its model about 8 times).
# Each job's exit status is logged (124: past its time limit). A job that ended in an earlier call on the same machine
# (still warm), whatever its status, is skipped, so a second call with the same jobs goes on where the first stopped
# (a job is known by its line as written, ` @SECONDS` included):
#   mapfile -t jobs < docs/measurements/CARD-DATE/jobs.txt; bash benchmarks/gpu_lease.sh "${jobs[@]}"
# Rows compare only with rows of the same card model, best of the same lease: the log names the card first, and
# each JSON row its device (the workplace lends H200s since 2026-11-28; the leases before were H100s).
# LEASE_DRY_RUN=1 sets nothing up and runs each job, fallbacks too, with a `python3` that prints its command line
# instead (`python3 ARGS`, shell-quoted, as the job would run it; what tests/test_lease_jobs.py reads), on any machine,
# in a scratch folder of its own (its OUT and RESULTS: a real run after it skips nothing); an `sh:` job's commands
# other than python3 run as written.
# JOB_LIMIT (seconds, default 300) bounds each job. `bash benchmarks/prepare_lease.sh` fills the git-ignored folders
# to carry with the call, before any device time is spent:
#   .whl      jaxcls's dependencies the GPU image lacks, as cp312 wheels
#   .gpudata  arcface_torch's bench (../shared/bench); for `--pipeline` jobs add glyphs' train.rec, train.idx, property
#   .gpucache/autotune  XLA:GPU's autotuning results per fusion (which cuDNN algorithm, which Triton tiling), that
#             JAX keeps beside its compilation cache: the newest lease's $OUT/autotune.tgz (kept in its
#             docs/measurements folder). Jobs then skip autotuning what an earlier lease tuned (it is keyed by the
#             GPU's model and each fusion's HLO, so other cards and changed code tune anew; an archive holds all it
#             carried, so one cache serves each card); the timed steps are the same programs, only compile_s shorter.
set -u
dry=${LEASE_DRY_RUN:-0}
if [[ $dry == 1 ]]; then
  scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
  OUT=$scratch/out RESULTS=$scratch/results
  mkdir -p "$scratch/bin"
  printf '#!/usr/bin/env bash\necho "python3 ${*@Q}"\n' > "$scratch/bin/python3" && chmod +x "$scratch/bin/python3"
  export PATH=$scratch/bin:$PATH
fi
OUT=${OUT:-/tmp/out}
export RESULTS=${RESULTS:-/tmp/results}
mkdir -p "$OUT" "$RESULTS"
touch "$RESULTS/done.txt"
exec > >(tee -a "$OUT/log.txt") 2>&1
if [[ $dry != 1 ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
  # a job that compiles what an earlier one did reuses it
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
  AUTOTUNE=$JAX_COMPILATION_CACHE_DIR/xla_gpu_per_fusion_autotune_cache_dir  # where JAX points XLA's autotuning cache
  mkdir -p "$AUTOTUNE"
  if [[ -d .gpucache/autotune ]]; then
    cp -rn .gpucache/autotune/. "$AUTOTUNE"/
    echo "autotuning cache: $(find "$AUTOTUNE" -type f | wc -l) entries carried"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
  jax.devices())'
fi
rc=0
for job in "$@"; do
  fallback=false; [[ $job == "|"* ]] && { fallback=true; job=${job#|}; }
  earlier=$(awk -F '\t' -v job="$job" '$2 == job {rc = $1} END {print rc}' "$RESULTS/done.txt")
  # (its status as it was, so that a `|JOB` after it runs on resume as it would have)
  [[ -n $earlier ]] && { echo "=== done in an earlier call (rc=$earlier): $job"; rc=$earlier; continue; }
  $fallback && (( rc == 0 )) && [[ $dry != 1 ]] && { echo "=== skipped, the job before it passed: $job"; continue; }
  limit=${JOB_LIMIT:-300}; run=$job
  if [[ $run =~ ^(.*[^[:space:]])[[:space:]]+@([1-9][0-9]*)[[:space:]]*$ ]]; then
    run=${BASH_REMATCH[1]}; limit=${BASH_REMATCH[2]}
  fi
  kind=${run%%:*}; spec=${run#*:}; name=$(echo "$kind-$spec" | tr -c 'A-Za-z0-9_.-' '_')
  echo "=== $(date +%T) $job"
  start=$SECONDS
  case $kind in
    train) args=(); prev=""
           for word in $spec; do  # KEY=VALUE selects grid rows (--only), except as the value of a --set
             [[ $word == *=* && $prev != --set ]] && args+=(--only); args+=("$word"); prev=$word
           done
           timeout "$limit" python3 benchmarks/step_throughput.py "${args[@]}" --out "$RESULTS/$name.json" ;;
    torch) read -r network batch classes extra <<< "$spec"
           [[ ${classes:-} == -* ]] && { extra="$classes ${extra:-}"; classes=""; }
           timeout "$limit" python3 .gpudata/bench/arcface_torch_bench.py \
             --network "$network" --batch "$batch" --classes "${classes:-1000000}" --sample-rate 0.1 --fp16 \
             ${extra:-} --out "$RESULTS/$name.json" ;;
    py)    timeout "$limit" python3 benchmarks/$spec --out "$RESULTS/$name.json" ;;
    sh)    timeout "$limit" bash -c "$spec" ;;
  esac
  rc=$?  # read before anything else runs: `$(date)` below would reset $?
  echo "=== $(date +%T) rc=$rc after $((SECONDS - start)) s: $job"
  printf '%s\t%s\n' "$rc" "$job" >> "$RESULTS/done.txt"
  [[ $dry == 1 ]] && continue
  tar czf "$OUT/results.tgz" "$RESULTS" benchmarks/results 2>/dev/null
  tar czf "$OUT/autotune.tgz" -C "$(dirname "$AUTOTUNE")" --transform "s|^$(basename "$AUTOTUNE")|autotune|" \
    "$(basename "$AUTOTUNE")"
done
