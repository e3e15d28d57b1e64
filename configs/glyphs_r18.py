"""Real data on a CPU: glyphs (1,500 kanji identities, 18,000 images) with a narrow IResNet-18.

    python -m jaxcls.train --config configs/glyphs_r18.py --workdir runs/glyphs_r18

Images are downsampled from 112 to 48 pixels and the IResNet is 1/4 as wide, so a 2-core CPU trains
at ~220-245 img/s. Half the images get a mild random resized crop, half a rotation of up to 8 degrees, half a
flip: at this length the mild warp did at least as well as the flip alone (94.9% +- 0.8 over three seeds against
one flip-only run's 94.3%; docs/training.md, "Augmentation on glyphs"). CosFace (m = 0.35), not ArcFace: with 12
images per identity, ArcFace from scratch collapses the eval-mode embeddings (verification stays at 50%) while
CosFace reaches 97% on a GPU (../shared/ANCHORS.md, calibration section); the collapse warning in the logs catches
the former.
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
    c.eval_bins = (os.path.join(c.data.root, "glyphs_pairs.bin"),)
    c.model = "r18"
    c.model_kwargs = dict(width=16)
    c.num_features = 128
    c.margin = dict(name="cosface", s=64.0, m=0.35, straight_through=False)
    c.batch_size = 128
    c.total_steps = 2750  # ~20 epochs, 25-29 minutes on an otherwise idle 2-core CPU
    c.warmup_steps = 100
    c.eval_every = 1375
    c.ckpt_every = 1375
    # a mild random resized crop and rotation on half the images each (docs/training.md, augmentation on glyphs)
    c.data.augment.update(crop=0.5, crop_scale=0.8, rotate=0.5, rotate_degrees=8.0)
    return c
