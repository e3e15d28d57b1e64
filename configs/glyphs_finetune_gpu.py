"""Fine-tune an imported arcface_torch r50 on new identities: glyphs' identities 750-1499, on one GPU.

    python -m jaxcls.train --config configs/glyphs_finetune_gpu.py --init_from runs/glyphs_finetune/imported \
        --workdir runs/glyphs_finetune/finetuned

The whole demonstration (split glyphs, train the r50 with arcface_torch's own code on identities 0-749, import it,
fine-tune here, export back) is benchmarks/glyphs_finetune.sh; docs/import.md has its measured verification.
``data.root`` is the second half that script packs (``jaxcls.data.pack --classes 750:1500``): 9,000 images of 750
identities the imported model never saw. A fresh FC over them, the backbone from ``--init_from``; the recipe of
configs/glyphs_r50_gpu.py (CosFace 0.35, batch 256, its augmentation) with a shorter, gentler schedule: 12 epochs,
peak learning rate 0.05 after one epoch of warm-up, so the random FC's first gradients do not undo the backbone.
Without ``--init_from`` the same schedule trains from random weights: the comparison the demonstration reports.
"""

import os

from jaxcls.config import face_config

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
GLYPHS = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "glyphs"))


def get_config():
    c = face_config(root=os.path.join(REPO, "runs", "glyphs_finetune", "glyphs_b"), num_classes=750,
                    num_images=9000, epochs=12, model="r50", margin=("cosface", 0.35), batch=256, lr=0.05,
                    warmup_epochs=1)
    c.eval_bins = (os.path.join(GLYPHS, "glyphs_pairs.bin"),)
    c.lr_power = 2.0  # as measured (docs/import.md), before face_config took train_v2.py's linear decay
    # follow a batch set on the command line; each its own reference (one shared object would make an override of
    # either set total_steps too)
    c.eval_every, c.ckpt_every = c.get_ref("total_steps") * 1, c.get_ref("total_steps") * 1
    c.log_every = 20
    c.data.augment.update(crop=0.5, crop_scale=0.8, rotate=0.5, rotate_degrees=8.0)
    return c
