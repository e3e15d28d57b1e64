"""Glint360K (360,232 ids, 17.1M images), r100, CosFace 0.4, weight decay 1e-4, 20 epochs, batch 128 × 8:
arcface_torch's configs/glint360k_r100.py."""

from jaxcls.config import face_config


def get_config():
    return face_config(root="/train_tmp/glint360k", num_classes=360232, num_images=17091657, epochs=20,
                       model="r100", margin=("cosface", 0.4), weight_decay=1e-4)
