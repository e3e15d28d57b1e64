"""Train a backbone with arcface_torch's own code on an insightface RecordIO folder and save it as arcface_torch does.

    python benchmarks/arcface_torch_train.py --data glyphs_a --network r50 --epochs 24 --batch 256 --out backbone.pth

Stands in for a user's arcface_torch model (docs/import.md: fine-tuning an imported model). The step is arcface_torch's
train_v2.py on one GPU: insightface's `get_model(network, dropout=0, fp16=True)` -> `PartialFC_V2(CombinedMarginLoss)`
-> GradScaler(growth_interval=100) -> `clip_grad_norm_(backbone, 5)` -> SGD(momentum 0.9) over backbone and FC, with
its PolynomialLRWarmup schedule (linear warm-up, then linear decay to 0: power 1, train_v2.py's default; the first
iteration at the base rate, as its scheduler leaves it) stepped per iteration. Its input transform: a
random horizontal flip, `(x/255 - 0.5)/0.5`, NCHW. The images are decoded once into device memory (glyphs: 9,000
images, 339 MB) and shuffled per epoch with the last partial batch dropped, as its DataLoader does. The backbone's
state dict is written with `torch.save(backbone.state_dict(), out)`: the file arcface_torch's `model.pt` is.

insightface's code is read from --insightface: a folder holding arcface_torch's `backbones/`, `partial_fc_v2.py` and
`losses.py`, unchanged. Needs torch and a GPU; on a CPU it runs too, only to check the script on a few identities.
The images are read with jaxcls's RecordIO reader, so MXNet is not needed.
"""
import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

from jaxcls.data.recordio import MXFaceDataset

INSIGHTFACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "bench", "insightface")


def decoded(root):
    """Every image of ``root`` as uint8 ``[N, H, W, 3]`` and its labels ``[N]``."""
    data = MXFaceDataset(root)
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        items = list(pool.map(data.__getitem__, range(len(data))))
    return np.stack([image for image, _ in items]), np.array([label for _, label in items]), data.num_classes()


def polynomial_warmup(step, warmup, total, power=1.0):
    """arcface_torch's PolynomialLRWarmup (lr_scheduler.py) as a factor of the base learning rate: iteration 0 at
    the base rate, then ``step / warmup`` up to ``warmup``, then ``(1 − (step − warmup) / (total − warmup))^power``.
    """
    if step == 0:
        return 1.0
    if step <= warmup:
        return step / warmup
    return max(0.0, 1 - (step - warmup) / max(total - warmup, 1)) ** power


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="an insightface RecordIO folder (train.rec, train.idx)")
    p.add_argument("--network", default="r50")
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--margin", type=float, nargs=3, default=(1.0, 0.0, 0.35), metavar=("M1", "M2", "M3"),
                   help="CombinedMarginLoss's m1 m2 m3 (default CosFace 0.35)")
    p.add_argument("--sample-rate", type=float, default=1.0)
    p.add_argument("--embedding", type=int, default=512)
    p.add_argument("--insightface", default=INSIGHTFACE, help="a folder holding arcface_torch's backbones/, "
                                                               "losses.py, partial_fc_v2.py")
    p.add_argument("--out", required=True, help="where to write the backbone's state dict")
    p.add_argument("--log", help="JSON of the run: settings, losses, speed")
    args = p.parse_args()
    sys.path.insert(0, args.insightface)
    from backbones import get_model
    from losses import CombinedMarginLoss
    from partial_fc_v2 import PartialFC_V2

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":  # partial_fc_v2.py calls .cuda() itself
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True  # as train_v2.py sets it
    start = time.perf_counter()
    images, labels, num_classes = decoded(args.data)
    images, labels = torch.from_numpy(images).to(dev), torch.from_numpy(labels).to(dev)
    decode_s = time.perf_counter() - start
    steps_per_epoch = len(images) // args.batch
    if steps_per_epoch == 0:
        sys.exit(f"error: {args.data} has {len(images)} images, fewer than one batch of {args.batch}")
    total, warmup = steps_per_epoch * args.epochs, steps_per_epoch * args.warmup_epochs

    backbone = get_model(args.network, dropout=0.0, fp16=True, num_features=args.embedding).to(dev).train()
    pfc = PartialFC_V2(CombinedMarginLoss(64, *args.margin), args.embedding, num_classes, args.sample_rate,
                       False).to(dev).train()
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}], lr=args.lr,
                          momentum=0.9, weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: polynomial_warmup(step, warmup, total))
    scaler = torch.amp.GradScaler(dev.type, growth_interval=100)
    losses, start = [], time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(images), device=dev)
        for b in range(steps_per_epoch):
            take = order[b * args.batch:(b + 1) * args.batch]
            x = images[take].permute(0, 3, 1, 2).float()
            flip = torch.rand(len(take), device=dev) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
            loss = pfc(backbone((x / 255 - 0.5) / 0.5), labels[take])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            schedule.step()
            losses.append(loss.item())
        print(f"epoch {epoch + 1}/{args.epochs}: loss {np.mean(losses[-steps_per_epoch:]):.3f}", flush=True)
    train_s = time.perf_counter() - start
    torch.save(backbone.state_dict(), args.out)
    result = {"data": args.data, "network": args.network, "images": len(images), "classes": num_classes,
              "epochs": args.epochs, "batch": args.batch, "steps": total, "margin": args.margin, "lr": args.lr,
              "decode_s": decode_s, "train_s": train_s, "img_per_s": total * args.batch / train_s,
              "loss_per_epoch": [float(np.mean(losses[i:i + steps_per_epoch]))
                                 for i in range(0, total, steps_per_epoch)],
              "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    print(json.dumps({k: v for k, v in result.items() if k != "loss_per_epoch"}))
    if args.log:
        with open(args.log, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
