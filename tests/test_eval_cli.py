"""``python -m jaxcls.eval`` over several runs: the mean ± sample std of every metric the runs share."""

import subprocess
import sys

import numpy as np
import pytest

from jaxcls.eval.__main__ import over_runs, report_over_runs


def test_over_runs_is_the_mean_and_sample_std_of_the_keys_every_run_has(rng):
    runs = [{"val/lfw/accuracy": a, "val/lfw/auc": u, "val/cfp/accuracy": c}
            for a, u, c in rng.uniform(0.5, 1.0, (3, 3))]
    del runs[1]["val/cfp/accuracy"]
    summary, left_out = over_runs(runs)
    accuracies = [r["val/lfw/accuracy"] for r in runs]
    mean, std, n = summary["val/lfw/accuracy"]
    assert n == 3 and mean == pytest.approx(sum(accuracies) / 3)
    assert std == pytest.approx(np.sqrt(sum((a - mean) ** 2 for a in accuracies) / 2))  # n - 1
    assert set(summary) == {"val/lfw/accuracy", "val/lfw/auc"} and left_out == ["val/cfp/accuracy"]
    assert over_runs(runs[:1])[0]["val/lfw/auc"] == (runs[0]["val/lfw/auc"], 0.0, 1)


def test_report_over_runs_prints_a_line_per_set_and_names_what_is_left_out(capsys):
    runs = [{"val/lfw/accuracy": 0.9, "val/lfw/auc": 0.95, "val/cfp/accuracy": 0.8},
            {"val/lfw/accuracy": 0.8, "val/lfw/auc": 0.85}]
    report_over_runs(runs)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "over 2 runs: mean ± sample std" and "TAR@1e-03" in lines[1]
    assert lines[2].split()[:4] == ["lfw", "0.8500", "±", "0.0707"]  # accuracy; auc 0.9000 ± 0.0707 next
    assert lines[2].split()[4:7] == ["0.9000", "±", "0.0707"] and lines[3] == "not in every run, left out: cfp"


def test_a_folder_that_is_no_run_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    done = subprocess.run([sys.executable, "-m", "jaxcls.eval", "--workdir", str(tmp_path / "empty")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"error: {tmp_path / 'empty'} is not a jaxcls run: it has no config.json" in done.stderr
