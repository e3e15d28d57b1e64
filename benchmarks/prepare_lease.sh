#!/usr/bin/env bash
# What a GPU lease carries, prepared on this machine before the device is asked for (no GPU needed), then the call to
# make. Device minutes count from the machine's start; nothing here spends them.
#
#   bash benchmarks/prepare_lease.sh [SHARED]     # SHARED holds arcface_torch's bench/ (default ../shared)
#
# .whl       jaxcls's dependencies that the GPU image (Python 3.12, jax, flax, optax, orbax, torch) lacks, as wheels
# .gpudata   arcface_torch's bench, for the torch: jobs and arcface_torch_max_classes.py
# .gpucache  the newest lease's XLA:GPU autotuning results (docs/measurements/CARD-DATE/autotune.tgz), so that the
#            jobs do not tune again what it tuned on that card
# All three are git-ignored; with the checkout they must stay within the device tool's 64 MiB.
# PIP overrides the command that downloads the wheels (default: python3 -m pip).
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${1:-../shared}
if [[ ! -f $shared/bench/arcface_torch_bench.py ]]; then
  echo "error: no arcface_torch bench at $shared/bench (give the folder that holds bench/)" >&2
  exit 1
fi
rm -rf .gpudata/bench && mkdir -p .gpudata && cp -r "$shared/bench" .gpudata/
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
  platforms+=(--platform "$tag")
done
${PIP:-python3 -m pip} download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl ml_collections simplejpeg grain array-record portpicker
# the newest lease's, of any card (a folder is named CARD-DATE[b]; each archive holds every card's results it carried)
autotune=$(find docs/measurements -path '*/h[0-9]*-20*/autotune.tgz' | sed -E 's|.*/h[0-9]+-([^/]+)/autotune.tgz$|\1 &|' \
  | sort | tail -n 1 | cut -d' ' -f2)
rm -rf .gpucache
if [[ -n $autotune ]]; then
  mkdir -p .gpucache && tar xzf "$autotune" -C .gpucache
  echo "autotuning results: $autotune"
fi
size=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s | awk '{s += $1} END {print s + 0}')
carried=$(du -cb .whl .gpudata .gpucache 2>/dev/null | tail -n 1 | cut -f1)
echo "checkout $((size / 1048576)) MiB + carried $((carried / 1048576)) MiB (the device tool takes 64 MiB)"
if (( size + carried > 64 * 1048576 )); then
  echo "error: more than the device tool carries" >&2
  exit 1
fi
echo 'then: the device tool (whichever card it lends: the jobs measure their own baselines), carry [".whl", ".gpudata",'
echo '".gpucache"], timeout_s 590:'
echo '  mapfile -t jobs < benchmarks/lease_jobs.txt; JOB_LIMIT=200 bash benchmarks/gpu_lease.sh "${jobs[@]}"'
echo 'and at once a second call with the same command (a warm machine is given back after 30 s idle)'
