"""Real data on a CPU: glyphs (1,500 kanji identities, 18,000 images) with a narrow IResNet-18.

    python -m jaxcls.train --config configs/glyphs_r18.py --workdir runs/glyphs_r18

Images are downsampled from 112 to 48 pixels and the IResNet is 1/4 as wide, so that a 2-core CPU trains it in
about half an hour. Batches of 64, a mild random resized crop and rotation on half the images each, and a flip.
CosFace, not ArcFace: with 12 images per identity ArcFace from scratch collapses the eval-mode embeddings. Scale
s = 32, not insightface's 64: at 64 training first sits on a loss plateau for several epochs. What each choice was
measured to do, and the recipe's verification over seeds: docs/training.md ("Augmentation on glyphs").
"""

import os

from jaxcls.config import base_config

GLYPHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "glyphs")


def get_config():
    c = base_config()
    c.data.kind = "recordio"
    c.data.root = os.path.normpath(GLYPHS)
    c.data.input_size = 48
    c.num_classes = 1500
    c.eval_bins = ("glyphs_pairs.bin",)  # in data.root
    c.model = "r18"
    c.model_kwargs = dict(width=16)
    c.num_features = 128
    c.margin.update(name="cosface", s=32.0, m=0.35, straight_through=False)
    c.batch_size = 64
    c.total_steps = 7000  # 25 epochs
    c.warmup_steps = 200
    c.eval_every = 3500
    c.ckpt_every = 3500
    # a mild random resized crop and rotation on half the images each (docs/training.md, augmentation on glyphs)
    c.data.augment.update(crop=0.5, crop_scale=0.8, rotate=0.5, rotate_degrees=8.0)
    return c
