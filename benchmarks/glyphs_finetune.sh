#!/usr/bin/env bash
# Fine-tuning an arcface_torch model with jaxcls, end to end on glyphs (docs/import.md), on one GPU:
#
#   bash benchmarks/glyphs_finetune.sh [OUTDIR]        # default runs/glyphs_finetune; ~6 minutes on an H100
#
# 1. glyphs split by identity: 0-749 (the "pretrained" model's data) and 750-1499 (the new task), by jaxcls.data.pack.
# 2. An r50 trained on the first half with insightface's own arcface_torch code (benchmarks/arcface_torch_train.py:
#    CosFace 0.35, 24 epochs of 256), saved as arcface_torch saves its backbone.
# 3. Its embeddings in PyTorch and in jaxcls after `jaxcls.convert --torch` (benchmarks/torch_agreement.py), then the
#    imported run's verification on glyphs_pairs.bin: "before".
# 4. `jaxcls.train --init_from` the imported run with a fresh FC on the second half (configs/glyphs_finetune_gpu.py):
#    "after"; the same schedule from random weights beside it.
# 5. The fine-tuned run back to a .pth (`jaxcls.convert --to-torch`), loaded strictly by insightface's get_model and
#    compared again.
# Every report lands in OUTDIR as JSON. Variables (for a dry run on a CPU with a small model and few steps):
# GLYPHS (the glyphs folder), NETWORK, CLASSES_A, CLASSES_B, TORCH_ARGS, TRAIN_ARGS (extra --config.* flags).
set -euo pipefail
cd "$(dirname "$0")/.."
GLYPHS=${GLYPHS:-../shared/data/glyphs}
OUT=${1:-runs/glyphs_finetune}
if [ -e "$OUT" ]; then echo "error: $OUT exists: give a new OUTDIR (each step writes a new folder)" >&2; exit 2; fi
NETWORK=${NETWORK:-r50}
read -r -a TORCH_ARGS <<< "${TORCH_ARGS:---epochs 24 --batch 256}"
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"
mkdir -p "$OUT"
step() { echo "=== $(date +%T) $*"; }

step "1. split glyphs by identity"
python3 -m jaxcls.data.pack --images "$GLYPHS" --classes "${CLASSES_A:-0:750}" --out "$OUT/glyphs_a"
python3 -m jaxcls.data.pack --images "$GLYPHS" --classes "${CLASSES_B:-750:1500}" --out "$OUT/glyphs_b"

step "2. $NETWORK trained by arcface_torch's code on the first half"
python3 benchmarks/arcface_torch_train.py --data "$OUT/glyphs_a" --network "$NETWORK" "${TORCH_ARGS[@]}" \
  --out "$OUT/arcface_torch_$NETWORK.pth" --log "$OUT/arcface_torch_train.json"

step "3. imported: embeddings against PyTorch's, then verification before fine-tuning"
python3 benchmarks/torch_agreement.py --pth "$OUT/arcface_torch_$NETWORK.pth" --network "$NETWORK" \
  --images "$OUT/glyphs_b/train.rec" --n 64 --out "$OUT/agreement_imported.json"
python3 -m jaxcls.convert --torch "$OUT/arcface_torch_$NETWORK.pth" --model "$NETWORK" --workdir "$OUT/imported"
python3 -m jaxcls.eval --workdir "$OUT/imported" --bin "$GLYPHS/glyphs_pairs.bin"

step "4. fine-tuned on the second half, and the same schedule from random weights"
FINETUNE=(--config configs/glyphs_finetune_gpu.py --config.data.root="$OUT/glyphs_b" "${TRAIN_ARGS[@]}"
          --config.eval_bins="('$GLYPHS/glyphs_pairs.bin',)")
python3 -m jaxcls.train "${FINETUNE[@]}" --init_from "$OUT/imported" --workdir "$OUT/finetuned"
python3 -m jaxcls.train "${FINETUNE[@]}" --workdir "$OUT/scratch"

step "5. the fine-tuned run back to arcface_torch"
python3 -m jaxcls.convert --to-torch "$OUT/finetuned_$NETWORK.pth" --workdir "$OUT/finetuned"
python3 benchmarks/torch_agreement.py --pth "$OUT/finetuned_$NETWORK.pth" --network "$NETWORK" \
  --images "$OUT/glyphs_b/train.rec" --n 64 --out "$OUT/agreement_finetuned.json"
step "done"
