"""Will a run fit? The compiled step's bytes per device by part (``memory``), for simulated CPU devices or
compile-only GPUs (``gpu_target``); what XLA's programs hold, read from their HLO text (``hlo``: collectives and the
bytes they move between hosts; ``kernels``: each kernel's kind, bytes and source line); ``planner`` turns the bytes
into a verdict and the largest class count, and ``python -m jaxcls.plan`` prints it."""
