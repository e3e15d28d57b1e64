"""WebFace42M (2,059,906 ids, 42.5M images), r50, ArcFace 0.5, PartialFC 0.2, 20 epochs, batch 256 × 8."""

from jaxcls.config import face_config


def get_config():
    return face_config(root="/train_tmp/WebFace42M", num_classes=2059906, num_images=42474557, epochs=20,
                       batch=2048, lr=0.2, sample_rate=0.2, warmup_epochs=1)
