"""Optional dependencies: the extra that installs each feature's packages, and an import that names it when missing."""

# The commands that install each optional feature's packages, wherever jaxcls was installed from. jax2onnx goes in
# without its dependencies: its metadata pins orbax-checkpoint < 0.11.37, which cannot restore jaxcls checkpoints (it
# never imports orbax), so no extra of pyproject.toml can install it.
INSTALL = {
    "export": ("pip install 'onnx>=1.20.1' 'onnx-ir>=0.2.1' 'onnxruntime>=1.24.1' "
               "&& pip install --no-deps jax2onnx==0.17.1"),
    "plot": "pip install matplotlib",
}


def optional_import(module: str, feature: str):
    """``import module``, or an ``ImportError`` giving the command that installs ``feature``'s packages."""
    try:
        return __import__(module)
    except ImportError as e:
        raise ImportError(f"{module} is not installed; install what {feature} needs with: {INSTALL[feature]}") from e
