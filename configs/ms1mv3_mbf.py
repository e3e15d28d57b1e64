"""MS1MV3, MobileFaceNet, ArcFace 0.5, 40 epochs, weight decay 1e-4, batch 128 × 8."""

from jaxcls.config import face_config


def get_config():
    return face_config(root="/train_tmp/ms1m-retinaface-t1", num_classes=93431, num_images=5179510, epochs=40,
                       model="mbf", weight_decay=1e-4)
