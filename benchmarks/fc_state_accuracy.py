"""Does a compact FC state cost accuracy? The glyphs recipe with PartialFC, per FC storage, over several seeds.

    python benchmarks/fc_state_accuracy.py --steps 2000 --seeds 0 1 2 --json results/fc_state_accuracy.json

Trains ``configs/glyphs_r18.py`` (1,500 identities) with ``sample_rate`` 0.2, so a class's weight row and
momentum are updated on about one step in five (as at millions of classes, where most rows sit unsampled for
many steps), for each FC storage in ``--states`` and each seed, one run after another in its own process, and
reports glyphs_pairs.bin verification (mean ± sample standard deviation over the seeds). A shortened schedule
(``--steps``) keeps the whole grid to about an hour and a half on a 2-core CPU; every storage gets the same one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> config overrides: the FC weight's storage and its momentum's
STATES = {
    "float32": {"fc_dtype": "float32"},
    "bfloat16": {"fc_dtype": "bfloat16"},
    "bfloat16-stochastic": {"fc_dtype": "bfloat16", "fc_weight_rounding": "stochastic"},
    "bfloat16+int8": {"fc_dtype": "bfloat16", "fc_state_dtype": "int8"},
    "bfloat16-stochastic+int8": {"fc_dtype": "bfloat16", "fc_weight_rounding": "stochastic", "fc_state_dtype": "int8"},
}


def run(state: str, seed: int, steps: int, warmup: int, sample_rate: float, workdir: Path) -> dict:
    """One training run: its final metrics row (verification accuracy and std, loss) and its wall seconds."""
    overrides = {**STATES[state], "seed": seed, "sample_rate": sample_rate, "total_steps": steps,
                 "warmup_steps": warmup, "eval_every": steps, "ckpt_every": steps}
    cmd = [sys.executable, "-m", "jaxcls.train", "--config", str(ROOT / "configs" / "glyphs_r18.py"),
           "--workdir", str(workdir)] + [f"--config.{k}={v}" for k, v in overrides.items()]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    final = [row for row in rows if any(k.endswith("/accuracy") for k in row)][-1]
    losses = [row["loss"] for row in rows if "loss" in row]
    return {"state": state, "seed": seed, "steps": steps, "warmup_steps": warmup, "sample_rate": sample_rate,
            "final": final, "final_loss": losses[-1], "seconds": seconds}


def summary(results: list[dict]) -> list[dict]:
    """Mean ± sample standard deviation of verification accuracy per storage."""
    table = []
    for state in dict.fromkeys(r["state"] for r in results):
        accs = [acc for r in results if r["state"] == state
                for k, acc in r["final"].items() if k.endswith("/accuracy")]
        table.append({"state": state, "seeds": [r["seed"] for r in results if r["state"] == state],
                      "accuracy": accs, "mean": statistics.mean(accs),
                      "sd": statistics.stdev(accs) if len(accs) > 1 else None})
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--states", nargs="+", default=list(STATES), choices=list(STATES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--sample_rate", type=float, default=0.2)
    p.add_argument("--json", type=Path, help="write every run and the summary here (rewritten after each run)")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="fc_state_accuracy_") as tmp:
        for seed in args.seeds:  # seeds outermost: an interrupted grid still compares every storage
            for state in args.states:
                workdir = Path(tmp) / f"{state}_{seed}"
                results.append(run(state, seed, args.steps, args.warmup, args.sample_rate, workdir))
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps({"argv": sys.argv, "runs": results,
                                                     "summary": summary(results)}, indent=1))
    print(f"{'FC storage':<16} {'seeds':<10} {'verification':<28} mean ± sd")
    for row in summary(results):
        sd = f" ± {row['sd']:.2%}" if row["sd"] is not None else ""
        print(f"{row['state']:<16} {str(row['seeds']):<10} {', '.join(f'{a:.2%}' for a in row['accuracy']):<28} "
              f"{row['mean']:.2%}{sd}")


if __name__ == "__main__":
    main()
