"""WebFace42M (2,059,906 ids, 42.5M images), r50, CosFace 0.4, PartialFC 0.2, 20 epochs (2 of warmup), lr 0.4, batch
128 × 32 (4,096): arcface_torch's configs/wf42m_pfc02_32gpus_r50_bs4k.py (its 8-GPU twin takes 512 × 8, the same)."""

from jaxcls.config import face_config


def get_config():
    return face_config(root="/train_tmp/WebFace42M", num_classes=2059906, num_images=42474557, epochs=20,
                       margin=("cosface", 0.4), batch=4096, lr=0.4, sample_rate=0.2, warmup_epochs=2)
