"""Models in and out of jaxcls: arcface_torch's ``.pth`` files read and written without torch (``torch_pth``),
its backbones mapped tensor by tensor (``arcface_torch``), ONNX and StableHLO export (``export``), a trained
backbone restored for inference and images embedded with it (``inference``)."""
