"""glyphs on one GPU: full-width IResNet-50 at 112×112, bfloat16, CosFace 0.35, 24 epochs of batch 256.

    python -m jaxcls.train --config configs/glyphs_r50_gpu.py --workdir runs/glyphs_r50_gpu

CosFace, not ArcFace, as in configs/glyphs_r18.py (with 12 images per identity ArcFace from scratch collapses), and
its augmentation (a mild crop and rotation on half the images each, flip), the best setting of the CPU study
(docs/training.md, "Augmentation on glyphs"). Each warped image costs the host about three JPEG decodes, so a fast
GPU wants several host cores for the data (``data.threads``). What it measured on an H100: docs/benchmarks.md.
"""

import os

from jaxcls.config import face_config

GLYPHS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                                       "glyphs"))


def get_config():
    c = face_config(root=GLYPHS, num_classes=1500, num_images=18000, epochs=24, model="r50",
                    margin=("cosface", 0.35), batch=256, lr=0.1, warmup_epochs=1)
    c.eval_bins = ("glyphs_pairs.bin",)  # in data.root
    c.lr_power = 2.0  # as measured (docs/import.md), before face_config took train_v2.py's linear decay
    # follow a batch set on the command line; each its own reference (an override of one leaves the other)
    c.eval_every, c.ckpt_every = c.get_ref("total_steps") // 2, c.get_ref("total_steps") // 2
    c.log_every = 20
    c.data.augment.update(crop=0.5, crop_scale=0.8, rotate=0.5, rotate_degrees=8.0)
    return c
