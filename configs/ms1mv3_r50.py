"""MS1MV3 (93,431 ids, 5.18M images), r50, ArcFace 0.5, 20 epochs, batch 128 × 8."""

from jaxcls.config import face_config


def get_config():
    return face_config(root="/train_tmp/ms1m-retinaface-t1", num_classes=93431, num_images=5179510, epochs=20)
