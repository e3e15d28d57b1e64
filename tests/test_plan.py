"""The planner: its report, verdicts, the largest class count, the command line."""

import json
import os
import subprocess
import sys

import jax
import pytest
from tiny import get_config

from jaxcls.plan import planner as plan_module
from jaxcls.plan.memory import ClassFit, GiB, StepMemory, apply_mem_fraction, mem_fraction
from jaxcls.plan.planner import cpu_caveats, plan, verdict


@pytest.mark.slow
def test_plan_reports_parts_verdict_and_the_largest_class_count_that_fits(monkeypatch, tmp_path):
    calls = []

    def solved(memory_at, limit, shards, rows):  # the solve itself: tests/test_memory.py
        calls.append((limit, shards, rows))
        return ClassFit(123_456, StepMemory({"FC weight": GiB}, "cpu"), 0.5 * GiB, 4096.0)

    monkeypatch.setattr(plan_module, "max_classes_that_fit", solved)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    result = plan(get_config(sample_rate=0.25, chunk_size=2**19), jax.devices()[:4], 2 * GiB, max_classes=True)
    text = "\n".join(result.lines())
    assert "compiled by XLA:CPU (jaxlib" in text and "for 4 × cpu" in text and "class=4" in text
    assert "FC weight" in text and "activations and temporaries" in text and "total per device" in text
    assert "verdict: fits:" in text and "of 1.50 GiB usable" in text  # JAX's default 75%
    assert calls == [(int(1.5 * GiB), 4, 2**22)]  # rows: PartialFC 0.25 samples two full tiles of 2**19
    assert "largest num_classes that fits: 123,456 (1.00 GiB per device; 512.00 MiB + 4,096 B per class)" in text
    saved = json.loads(json.dumps(result.to_json()))
    assert saved["target"] == "cpu" and saved["devices"] == 4 and saved["device_memory"] == 2 * GiB
    assert saved["usable_bytes"] == int(1.5 * GiB) and saved["mem_fraction"] == 0.75 and saved["fits"] is True
    assert saved["parts"] == result.memory.parts and saved["total_bytes"] == result.memory.total
    assert (saved["max_classes"], saved["bytes_per_class"], saved["fixed_bytes"]) == (123_456, 4096.0, 0.5 * GiB)


def test_verdicts():
    assert verdict(50 * GiB, 60 * GiB, 80 * GiB).startswith("fits: 50.00 GiB of 60.00 GiB usable (10.00 GiB spare)")
    assert "--config.mem_fraction=0.87" in verdict(68 * GiB, 60 * GiB, 80 * GiB)
    assert verdict(79 * GiB, 60 * GiB, 80 * GiB).startswith("does not fit: 79.00 GiB > 60.00 GiB")


def test_the_memory_fraction_is_the_configs_else_the_environments_else_jaxs(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert mem_fraction(get_config()) == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert mem_fraction(get_config()) == 0.9 and mem_fraction(get_config(mem_fraction=0.95)) == 0.95
    with pytest.raises(ValueError, match="config.mem_fraction=0.95 but the environment has "
                                         "XLA_PYTHON_CLIENT_MEM_FRACTION=.9: set one of them"):
        apply_mem_fraction(get_config(mem_fraction=0.95))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    apply_mem_fraction(get_config(mem_fraction=0.95))
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"


def test_cpu_caveats_name_16_bit_compute_and_not_a_16_bit_fc_state_which_xla_cpu_updates_in_place():
    notes = cpu_caveats(get_config(fc_dtype="bfloat16", precision="bfloat16"))
    assert len(notes) == 1 and "bfloat16 compute" in notes[0]
    assert cpu_caveats(get_config(fc_dtype="bfloat16")) == []


@pytest.mark.slow
@pytest.mark.parametrize("args, status, expected", [
    (["--devices", "2", "--device-memory", "1MiB"], 0, "verdict: does not fit"),
    (["--device-memory", "lots"], 1, "error: cannot read 'lots' as a size"),
    (["--devices", "3"], 1, "error: batch_size 32 is not divisible by 3 devices"),
    (["--json", "/nowhere/plan.json"], 1, "error: --json /nowhere/plan.json: its folder does not exist"),
])
def test_command_line(args, status, expected):
    proc = subprocess.run([sys.executable, "-m", "jaxcls.plan", "--config", "tests/tiny.py", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == status, proc.stderr
    assert expected in proc.stdout + proc.stderr
    if status:
        assert "Traceback" not in proc.stderr


def test_ptxas_reports_and_triton_launches_are_read_as_written():
    from jaxcls.plan import ptx

    report = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'rows_update' for 'sm_90a'
ptxas info    : Function properties for rows_update
    344 bytes stack frame, 340 bytes spill stores, 340 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 344 bytes cumulative stack size
ptxas info    : Compiling entry function 'rows_stats' for 'sm_90a'
ptxas info    : Function properties for rows_stats
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 72 registers, used 1 barriers
"""
    assert ptx.parse_ptxas_report(report) == {
        "rows_update": {"registers": 255, "spill_bytes": 340, "stack_bytes": 344},
        "rows_stats": {"registers": 72, "spill_bytes": 0, "stack_bytes": 0}}
    hlo = ('%pallas_call.8 = (f32[2048,128]{1,0}) custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", '
           'backend_config={debug = false, grid_x = 2 : i32, grid_y = 2048 : i32, grid_z = 1 : i32, ir = "x", '
           'name = "rows_stats", num_stages = 3 : i32, num_warps = 4 : i32}\n%other = f32[2] add(%a, %b)')
    assert ptx.triton_launches(hlo) == {"rows_stats": {"grid": (2, 2048, 1), "warps": 4, "stages": 3}}
    # 72 registers: 2,304 a warp, 28 warps an SM, 7 programs of 4; 255 → 256: 8,192 a warp, 8 warps, 2 programs
    assert [ptx.programs_per_sm(r, w) for r, w in [(72, 4), (255, 4), (202, 8), (16, 1)]] == [7, 2, 1, 32]
    # 192 registers: two warps in each quarter of the register file, 8 in all (a whole-file count gave 10)
    assert [ptx.programs_per_sm(192, w) for w in (1, 2)] == [8, 4]


def test_a_gpus_device_kind_names_its_target_for_the_trainers_advice():
    from jaxcls.plan.gpu_target import target_of

    kinds = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100-80gb",
             "NVIDIA A100-SXM4-40GB": None, "cpu": None}
    assert {kind: target_of(kind) for kind in kinds} == kinds
