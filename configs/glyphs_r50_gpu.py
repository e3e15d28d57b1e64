"""glyphs on one GPU: full-width IResNet-50 at 112×112, bfloat16, CosFace 0.35, 24 epochs of batch 256.

    python -m jaxcls.train --config configs/glyphs_r50_gpu.py --workdir runs/glyphs_r50_gpu

On one H100 (2026-11-25): 1,680 steps at ~6,450 img/s in 77 s, 146 s with compiling and two evaluations;
98.55% ± 0.72 verification on 2,000 of glyphs_pairs.bin's pairs (docs/benchmarks.md). The plain Flax r18 of
../shared/ANCHORS.md reached 97.3% on glyphs_pairs.bin with this schedule and data at 112×112, flip only. CosFace,
not ArcFace: with 12 images per identity ArcFace from scratch collapses (configs/glyphs_r18.py says more).
The augmentation of configs/glyphs_r18.py (a mild crop and rotation on half the images each, flip), the best
setting of the CPU study (docs/training.md, "Augmentation on glyphs"); 3 in 4 images are warped at ~310 us
each (112 px, one core), so ~1.2 host cores at the r50 step's ~5,000 img/s.
"""

import os

from jaxcls.config import face_config

GLYPHS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                                       "glyphs"))


def get_config():
    c = face_config(root=GLYPHS, num_classes=1500, num_images=18000, epochs=24, model="r50",
                    margin=("cosface", 0.35), batch=256, lr=0.1, warmup_epochs=1)
    c.eval_bins = (os.path.join(GLYPHS, "glyphs_pairs.bin"),)
    c.eval_every = c.ckpt_every = c.total_steps // 2
    c.log_every = 20
    c.data.augment.update(crop=0.5, crop_scale=0.8, rotate=0.5, rotate_degrees=8.0)
    return c
