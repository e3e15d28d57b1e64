"""benchmarks/lease_jobs.txt, the next GPU lease's jobs, as benchmarks/gpu_lease.sh's dry run prints them: every job
names a script that exists and arguments that script accepts, and a train step's job selects a row of its grid and a
config that validates. A lease has about 15 device minutes; a misspelt flag found on the GPU costs one of its jobs."""

import argparse
import functools
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxcls.bench import CONFIG_KEY, select
from jaxcls.config import benchmark_config, validate
from test_benchmarks import benchmark

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT.parent / "shared" / "bench"  # where the lease's .gpudata/bench is copied from
JOBS = [line for line in (ROOT / "benchmarks" / "lease_jobs.txt").read_text().splitlines() if line.strip()]


def commands(jobs: tuple[str, ...]) -> dict[str, tuple[Path, list[str]]]:
    """``{job: (script, arguments)}``: what gpu_lease.sh runs for each job (a ``|`` fallback's without its ``|``), as
    its dry run (``LEASE_DRY_RUN=1``) prints them; arcface_torch's bench read from ../shared/bench. Every job runs one
    python3 command, an ``sh:`` job's a script of benchmarks/."""
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_lease.sh"), *jobs], cwd=ROOT,
                          env=os.environ | {"LEASE_DRY_RUN": "1"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:]  # the script's stderr goes to its log, on stdout
    found, job = {}, None
    for line in proc.stdout.splitlines():
        if started := re.fullmatch(r"=== \d\d:\d\d:\d\d (.*)", line):
            job = None if re.match(r"rc=\d+ after ", started.group(1)) else started.group(1)
        elif job and line.startswith("python3 "):
            found.setdefault(job, []).append(shlex.split(line)[1:])
    missing = [j for j in jobs if j.removeprefix("|") not in found]
    assert not missing, f"gpu_lease.sh's dry run ran no python3 for {missing}: {proc.stdout[-2000:]}"
    many = {j: c for j, c in found.items() if len(c) != 1}
    assert not many, f"jobs that run more than one python3 command: {many}"
    outside = [j for j, [[script, *_]] in found.items() if j.startswith("sh:") and not script.startswith("benchmarks/")]
    assert not outside, f"sh: jobs whose python3 runs no script of benchmarks/: {outside}"
    return {j: (BENCH / script.removeprefix(".gpudata/bench/") if script.startswith(".gpudata/bench/")
                else ROOT / script, args) for j, [[script, *args]] in found.items()}


def command(job: str) -> tuple[Path, list[str]]:
    """``(script, arguments)`` that gpu_lease.sh runs for ``job``."""
    return commands((job,))[job.removeprefix("|")]


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


@functools.cache
def lease_commands() -> dict[str, tuple[Path, list[str]]]:
    return commands(tuple(JOBS))


@pytest.mark.parametrize("job", JOBS)
def test_every_job_of_the_next_lease_is_accepted_by_its_script(job, monkeypatch, capsys):
    script, args = lease_commands()[job.removeprefix("|")]
    if script.is_relative_to(BENCH) and not BENCH.exists():
        pytest.skip(f"arcface_torch's bench is not at {BENCH}")
    assert script.exists(), f"{job}: no {script}"
    parser, namespace = parsed_arguments(script, args, monkeypatch, capsys)
    overrides = [a.dest for a in parser._actions if a.help == CONFIG_KEY]  # --set KEY=VALUE, as a jaxcls config key
    if script.name == "step_throughput.py":  # the grid rows --only selects, each with the --set overrides
        throughput = benchmark("step_throughput")
        grid = select(throughput.GRID, throughput.KEYS, namespace.only)
        rows = [dict(zip(throughput.CONFIG_KEYS, spec)) for spec in grid]
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
    script, args = command("sh:XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 benchmarks/loss.py --out $RESULTS/x.json @3")
    assert script == ROOT / "benchmarks" / "loss.py" and args[0] == "--out" and args[1].endswith("/results/x.json")
    assert command("|torch:r50 128 --max-classes @500")[1][:6] == ["--network", "r50", "--batch", "128", "--classes",
                                                                 "1000000"]
