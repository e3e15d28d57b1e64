"""JAX started without its CUDA plugin's noise where the plugin cannot work: which lines and log records are dropped
(every other line kept), when anything is done at all, and a CLI's first line with the plugin installed."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxcls import startup

ROOT = Path(__file__).resolve().parents[1]
NOISE = [  # what the plugin writes to descriptor 2 on every import of jax on a machine without an NVIDIA driver
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    "I0000 00:00:1795662999.499493    4940 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will "
    "not be used.\n",
    "E1126 03:16:41.621633    4940 cudart_stub.cc:31] Could not find cuda drivers on your machine.\r\n",
]
KEPT = [
    "UserWarning: what jax warned while it was imported\n",
    "W0000 00:00:1795662999.499493    4940 other_file.cc:12] other C++ code's line about cudart_stub.cc\n",
    "see cudart_stub.cc:31] Could not find cuda drivers\n",
    "the log said: WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    "\n",
]


def test_only_the_plugins_lines_are_dropped_and_every_other_line_is_kept_as_it_was():
    text = "".join(line for pair in zip(NOISE * 2, KEPT) for line in pair) + "a last line without a newline"
    assert startup.without_plugin_noise(text) == "".join(KEPT) + "a last line without a newline"
    assert startup.without_plugin_noise("".join(NOISE) + NOISE[1].strip()) == ""
    assert startup.without_plugin_noise("") == ""


def record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("jax._src.xla_bridge", logging.ERROR, "xla_bridge.py", 510, msg, args, None)


def test_only_the_record_of_a_cuda_plugins_failed_initialization_is_dropped():
    failed = "Jax plugin configuration error: Exception when calling %s.initialize()"
    assert not startup.not_a_failed_initialize(record(failed, "jax_plugins.xla_cuda12"))
    assert not startup.not_a_failed_initialize(record(failed, "jax_plugins.xla_cuda13"))
    assert startup.not_a_failed_initialize(record(failed, "jax_plugins.xla_tpu"))
    assert startup.not_a_failed_initialize(record("Jax plugin configuration error: Plugin module %s could not be "
                                                  "loaded"))
    assert startup.not_a_failed_initialize(record("Unable to initialize backend 'cuda': %s", "no driver"))


@pytest.mark.parametrize("plugin, driver, dropped", [(True, False, True), (True, True, False), (False, False, False)])
def test_records_are_dropped_only_with_the_plugin_and_without_a_driver(plugin, driver, dropped, tmp_path, monkeypatch):
    logger = logging.getLogger("jax._src.xla_bridge")
    monkeypatch.setattr(logger, "filters", [])  # (restored afterwards)
    monkeypatch.setattr(startup, "plugin_installed", lambda: plugin)
    (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module\n")
    driver_file = tmp_path / ("version" if driver else "absent")
    monkeypatch.setattr(startup, "NVIDIA_DRIVER", (str(tmp_path / "absent"), str(driver_file)))
    startup.start_jax()  # jax is imported already: at most the filter is added
    assert (startup.not_a_failed_initialize in logger.filters) == dropped


@pytest.mark.gpu_target
@pytest.mark.skipif(any(map(os.path.exists, startup.NVIDIA_DRIVER)), reason="an NVIDIA driver is present: "
                    "jaxcls.startup leaves JAX's output alone")
@pytest.mark.parametrize("platforms", [None, "cpu"])  # JAX's choice, as a user's; or the CPU (the plugin still loads)
def test_a_cli_says_its_own_error_first_with_the_plugin_installed(platforms, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    run = lambda *args: subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, timeout=300)
    plain = run("-c", "import jax; jax.devices()")  # without jaxcls first the plugin is heard: what startup removes
    assert "cudart_stub" in plain.stdout, plain.stdout
    assert ("plugin configuration error" in plain.stdout) == (platforms is None), plain.stdout
    quiet = run("-c", "import jaxcls, jax; jax.devices()")
    assert (quiet.returncode, quiet.stdout) == (0, "")

    proc = run("-m", "jaxcls.train", "--config", "configs/ms1mv3_r50.py", "--workdir", str(tmp_path))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1 and lines[0].startswith("error:") and "train.rec" in lines[0], proc.stdout
    assert not [line for line in lines if "cudart_stub" in line or "plugin configuration error" in line], proc.stdout
