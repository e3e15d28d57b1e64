"""Will a config fit? (``jaxcls.plan.planner`` says how the plan is made.)

``python -m jaxcls.plan --config configs/<x>.py [--config.key=value] [--target h100] [--devices 8]
[--device-memory 80GiB] [--max-classes] [--json plan.json]``
"""

from __future__ import annotations

import json
import os

from absl import flags

from jaxcls.config import define_config_flag
from jaxcls.plan import gpu_target
from jaxcls.plan.memory import parse_bytes
from jaxcls.plan.planner import TARGETS, plan, target_devices
from jaxcls.reporting import configure_logging, run_cli


def main(argv):
    del argv  # run_cli refuses positional arguments
    f = flags.FLAGS
    count, target = f["devices"].value, f["target"].value
    device_memory = (parse_bytes(f["device-memory"].value) if f["device-memory"].value
                     else gpu_target.device_memory(target) if target != "cpu" else parse_bytes("80GiB"))
    configure_logging(verbose=f["verbosity"].present)
    if f["json"].value and not os.path.isdir(os.path.dirname(os.path.abspath(f["json"].value))):
        raise ValueError(f"--json {f['json'].value}: its folder does not exist")  # before minutes of compiling
    result = plan(f.config, target_devices(target, count), device_memory, f["max-classes"].value, target)
    print("\n".join(result.lines()))
    if f["json"].value:
        with open(f["json"].value, "w") as out:
            json.dump(result.to_json(), out, indent=1)
        print(f"wrote {f['json'].value}")


def define_flags():
    define_config_flag()
    flags.DEFINE_enum("target", "cpu", TARGETS, "compile with XLA:CPU for simulated devices, or with XLA:GPU for "
                      "this GPU (needs JAX's CUDA plugin: pip install -e '.[plan-gpu]'; no GPU)")
    flags.DEFINE_integer("devices", 8, f"devices the run will have (GPUs: at most {gpu_target.GPUS_PER_HOST} on "
                         f"one host, else hosts of {gpu_target.GPUS_PER_HOST})", lower_bound=1)
    flags.DEFINE_string("device-memory", None, "memory of one device, e.g. 80GiB, 24GB (default: the GPU target's, "
                        "80GiB for cpu)")
    flags.DEFINE_bool("max-classes", False, "also find the largest num_classes that fits")
    flags.DEFINE_string("json", None, "also write the plan as JSON to this path")


if __name__ == "__main__":
    define_flags()
    run_cli(main)
