"""Embeddings of an arcface_torch backbone in PyTorch and after `jaxcls.convert --torch`, on this machine's device.

    python benchmarks/torch_agreement.py --pth backbone.pth --network r50 --images glyphs/train.rec [--n 256]

The reference is insightface's `get_model(network)` in float64 on the CPU, in eval mode. Against it: PyTorch on the
device in float32 (TF32 off, then PyTorch's default, where cuDNN convolutions may use TF32) and `jaxcls.embed`'s
embedder of the converted run (JAX's default matmul precision, then "highest"). Per row: 1 − the lowest cosine and the
largest max |got − want| / max |want| over the embeddings (tests/test_convert.py's measure, there on the CPU).
Images are read and resized by `jaxcls.embed`'s loader and given to both frameworks as `(x/255 − 0.5)/0.5`, NCHW.
insightface's code comes from --insightface (a folder holding arcface_torch's `backbones/`).
"""
import argparse
import os
import sys
import tempfile

import jax
import numpy as np
import torch

from jaxcls.bench import print_table, write_json
from jaxcls.interop.arcface_torch import embedding_size, import_torch
from jaxcls.interop.inference import agreement, embed_images, image_source, open_embedder
from jaxcls.interop.torch_pth import load_state_dict

INSIGHTFACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "bench", "insightface")


def measured(got, want) -> dict:
    cosine, relative = agreement(got, want)
    return {"one_minus_min_cosine": 1 - cosine, "max_relative_error": relative}


def torch_embeddings(model, images: np.ndarray, device: str, dtype, tf32_convolutions: bool) -> np.ndarray:
    """``model``'s embeddings of uint8 ``images``; cuDNN convolutions in TF32 or not, matmuls never (PyTorch's
    defaults are TF32 convolutions and float32 matmuls)."""
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32_convolutions, False
    x = torch.from_numpy(images.transpose(0, 3, 1, 2).astype(np.float64) / 255 * 2 - 1)
    model = model.to(device=device, dtype=dtype)
    with torch.no_grad():
        return model(x.to(device=device, dtype=dtype)).double().cpu().numpy()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pth", required=True)
    p.add_argument("--network", default="r50")
    p.add_argument("--images", required=True, help="what jaxcls.embed reads: a folder, a .rec file, a list")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--insightface", default=INSIGHTFACE)
    p.add_argument("--out", help="JSON of the rows")
    args = p.parse_args()
    sys.path.insert(0, args.insightface)
    from backbones import get_model

    state = load_state_dict(args.pth)
    model = get_model(args.network, num_features=embedding_size(state, args.network)).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="torch_agreement-") as tmp:
        workdir = os.path.join(tmp, "run")
        import_torch(args.pth, args.network, workdir)
        names, loaders = image_source(args.images, open_embedder(workdir).input_size)
        names, loaders = names[:args.n], loaders[:args.n]
        images = np.stack([load() for load in loaders])
        want = torch_embeddings(model, images, "cpu", torch.float64, False)
        rows = [{"embeddings": f"PyTorch {device} float32, TF32 off", **measured(
                    torch_embeddings(model, images, device, torch.float32, False), want)},
                {"embeddings": f"PyTorch {device} float32, its defaults (cuDNN convolutions in TF32)", **measured(
                    torch_embeddings(model, images, device, torch.float32, True), want)}]
        for precision in ("default", "highest"):  # a fresh embedder each: its program traced under the precision
            with jax.default_matmul_precision(precision):
                got = embed_images(open_embedder(workdir), loaders, names, batch_size=min(args.n, 256),
                                   progress=False)[0]
            rows.append({"embeddings": f"jaxcls {jax.devices()[0].platform} float32, matmul precision {precision}",
                         **measured(got, want)})
    print(f"{args.network} from {args.pth}, {len(images)} images of {args.images}; reference: PyTorch float64 CPU")
    print_table(rows, ["embeddings", "one_minus_min_cosine", "max_relative_error"])
    if args.out:
        write_json(args.out, [dict(row, network=args.network, images=len(images), torch=torch.__version__)
                              for row in rows])


if __name__ == "__main__":
    main()
