"""benchmarks/lease_jobs.txt, the next GPU lease's jobs, read as benchmarks/gpu_lease.sh reads them: every job names a
script that exists and arguments that script accepts, and a train step's job selects a row of its grid and a config
that validates. A lease has about 15 device minutes; a misspelt flag found on the GPU costs one of its jobs."""

import argparse
import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from jaxcls.bench import CONFIG_KEY, select
from jaxcls.config import benchmark_config, validate
from test_benchmarks import benchmark

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT.parent / "shared" / "bench"  # where the lease's .gpudata/bench is copied from
JOBS = [line for line in (ROOT / "benchmarks" / "lease_jobs.txt").read_text().splitlines() if line.strip()]
OUT = "/results/out.json"  # no job runs: any path will do


def command(job: str) -> tuple[Path, list[str]]:
    """``(script, arguments)`` that gpu_lease.sh runs for ``job`` (its `|` and ` @SECONDS` taken off)."""
    job = re.sub(r"\s+@[1-9][0-9]*\s*$", "", job.removeprefix("|"))
    kind, spec = job.split(":", 1)
    if kind == "train":  # KEY=VALUE selects grid rows, except as a --set's value
        words, args = spec.split(), []
        for prev, word in zip([None, *words], words):
            args += ["--only", word] if "=" in word and prev != "--set" else [word]
        return ROOT / "benchmarks" / "step_throughput.py", [*args, "--out", OUT]
    if kind == "torch":
        network, batch, *rest = spec.split()
        classes = rest.pop(0) if rest and not rest[0].startswith("-") else "1000000"
        return BENCH / "arcface_torch_bench.py", ["--network", network, "--batch", batch, "--classes", classes,
                                                  "--sample-rate", "0.1", "--fp16", *rest, "--out", OUT]
    if kind == "py":
        script, *args = shlex.split(spec)
        return ROOT / "benchmarks" / script, [*args, "--out", OUT]
    assert kind == "sh", f"{job}: unknown kind {kind}"
    words = shlex.split(spec.replace("$RESULTS", "/results"))
    while re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # environment assignments
        words.pop(0)
    assert words[0] == "python3" and words[1].startswith("benchmarks/"), f"{job}: not a benchmark script"
    return ROOT / words[1], words[2:]


class Parsed(Exception):
    """Raised by a script's parse_args once it has parsed: ``(parser, namespace)``, nothing run."""


def parsed_arguments(script: Path, args: list[str], monkeypatch, capsys):
    """``(parser, namespace)``: what ``script``'s main() parses from ``args``; an argument it refuses fails the test,
    with its message."""
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, *a):
        raise Parsed(self, parse(self, *a))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])  # as `python3 script` sees it
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # a script may add to it before parsing
    before = set(sys.modules)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except Parsed as done:
        return done.args
    except SystemExit as refused:
        pytest.fail(f"{script.name} {shlex.join(args)}: {capsys.readouterr().err.strip() or refused}")
    finally:  # the modules of the script's folder (arcface_torch's `backbones`, `losses`) do not stay for other tests
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(script.parent)):
                del sys.modules[name]
    pytest.fail(f"{script.name} ran to its end without parsing its arguments")


@pytest.mark.parametrize("job", JOBS)
def test_every_job_of_the_next_lease_is_accepted_by_its_script(job, monkeypatch, capsys):
    script, args = command(job)
    if script.is_relative_to(BENCH) and not BENCH.exists():
        pytest.skip(f"arcface_torch's bench is not at {BENCH}")
    assert script.exists(), f"{job}: no {script}"
    parser, namespace = parsed_arguments(script, args, monkeypatch, capsys)
    overrides = [a.dest for a in parser._actions if a.help == CONFIG_KEY]  # --set KEY=VALUE, as a jaxcls config key
    if script.name == "step_throughput.py":  # the grid rows --only selects, each with the --set overrides
        throughput = benchmark("step_throughput")
        rows = [dict(zip(["model", "batch_size", "num_classes", "sample_rate", "precision"], spec))
                for spec in select(throughput.GRID, throughput.KEYS, namespace.only)]
    else:
        rows = [{}]
    for keys in rows if overrides else []:
        validate(benchmark_config(overrides=getattr(namespace, overrides[0]), **keys), num_devices=1)
    if script.name == "fc_kernels.py":  # its --set names kernel constants: checked as its main() checks them
        kernels = benchmark("fc_kernels")
        try:
            kernels._settings(namespace.set), kernels._variants(namespace.fc_kernels, namespace.set)
        except SystemExit as refused:
            pytest.fail(f"{job}: {refused}")


def test_a_misspelt_flag_or_a_row_outside_the_grid_fails(monkeypatch, capsys):
    script, args = command("train:model=r50 batch=128 --fc-kernals pallas_update")
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --fc-kernals"):
        parsed_arguments(script, args, monkeypatch, capsys)
    throughput = benchmark("step_throughput")
    with pytest.raises(SystemExit, match="no row of the grid matches; its values: model mbf, r100, r50; batch 128"):
        select(throughput.GRID, throughput.KEYS, ["model=mbf", "batch=128"])
    with pytest.raises(SystemExit, match="--only model: expected KEY=VALUE, KEY one of model, batch, classes"):
        select(throughput.GRID, throughput.KEYS, ["model"])
    assert command("sh:XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 benchmarks/loss.py --out $RESULTS/x.json @300") == (
        ROOT / "benchmarks" / "loss.py", ["--out", "/results/x.json"])
    assert command("|torch:r50 128 --max-classes @500")[1][:6] == ["--network", "r50", "--batch", "128", "--classes",
                                                                 "1000000"]
