"""arcface_torch backbones into jaxcls and back (``jaxcls.interop.arcface_torch``, ``jaxcls.convert``): checked
against insightface's own PyTorch code.

Each model is built in PyTorch with random weights, random BatchNorm affine parameters and running statistics and
random PReLU slopes, converted, and its jaxcls embeddings of real (glyph) images compared with PyTorch's, in float32,
with arcface_torch's input convention (RGB, (x/255 − 0.5)/0.5, NCHW 112×112). Those tests need torch and
insightface's code and skip without them; the committed fixtures in tests/fixtures (r18, mbf and a narrow ViT,
written by insightface's code) check the same without either.
"""

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import free_port
from jaxcls.checkpoint import CheckpointError
from jaxcls.interop.arcface_torch import (ARCFACE_MODELS, arcface_name, import_torch, jaxcls_to_torch, run_config,
    torch_keys, torch_to_jaxcls, write_run)
from jaxcls.errors import DataError
from jaxcls.interop.inference import Embedder, agreement, deployed, deployed_input, restore_backbone
from jaxcls.interop.torch_pth import load_state_dict, save_pth

INSIGHTFACE = Path(__file__).resolve().parents[2] / "shared" / "bench" / "insightface"
pytestmark = pytest.mark.filterwarnings("ignore:`torch.cuda.amp.autocast:FutureWarning")  # insightface's code
GLYPHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "glyphs"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
COSINE, RELATIVE = 0.99999, 2e-5  # per embedding, float32


@pytest.fixture(scope="module")
def torch():
    """PyTorch, for the tests that run insightface's models live: they skip without it or without insightface's code."""
    if not (INSIGHTFACE / "backbones" / "__init__.py").is_file():
        pytest.skip(f"insightface's arcface_torch backbones not found at {INSIGHTFACE}/backbones")
    return pytest.importorskip("torch", reason="torch is needed to run insightface's PyTorch models live")


def import_file(name: str, path: Path):
    """The module at ``path`` (the package, for an ``__init__.py``), imported under ``name``."""
    package = [str(path.parent)] if path.name == "__init__.py" else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=package)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def insightface():
    """insightface's ``backbones`` package (``get_model``), imported under a name of its own."""
    import torch
    torch.set_num_threads(1)  # pytest runs two workers on two cores; two threads each wait on each other
    return import_file("insightface_backbones", INSIGHTFACE / "backbones" / "__init__.py")


@functools.cache
def recorded(name: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """``(state dict, uint8 images, embeddings)``: insightface's ``name`` as tests/fixtures/make_cnn_reference.py
    recorded it, its weights drawn again by that script's recipe (numpy only, no torch)."""
    maker = import_file("make_cnn_reference", FIXTURES / "make_cnn_reference.py")
    reference = np.load(FIXTURES / f"{name}_reference.npz")
    state = maker.recipe_state(json.loads((FIXTURES / f"{name}_reference.json").read_text()))
    return state, reference["images"], reference["embeddings"]


@functools.cache
def images(n: int = 4) -> np.ndarray:
    """``n`` real 112×112 RGB uint8 images: glyph photos, or procedural glyphs where the data set is absent."""
    if (GLYPHS / "train.rec").exists():
        from jaxcls.data.recordio import MXFaceDataset
        data = MXFaceDataset(GLYPHS)
        return np.stack([data[i * 997 % len(data)][0] for i in range(n)])
    from jaxcls.data.sources import ProceduralGlyphs
    return np.stack([ProceduralGlyphs(size=112).image(i, 0) for i in range(n)])


def torch_model(name: str, seed: int = 0, calibration_images: int = 2):
    """insightface's ``name`` in eval mode with random weights and random BatchNorm and PReLU values.

    The running statistics are those of a batch of real images (so that activations keep their scale through
    200 layers; the embedding BatchNorm1d's variances their mean over the features), then randomly scaled
    (var × U(0.5, 2)) and shifted (mean + 0.1 σ N(0, 1)); BatchNorm weights
    U(0.5, 1.5) but the IResNet's frozen ``features.weight`` (1), biases N(0, 0.1), PReLU slopes U(0, 0.5),
    ``num_batches_tracked`` 123."""
    import torch
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = insightface().get_model(name)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.momentum = None  # cumulative average: the calibration batch's statistics
                m.reset_running_stats()
        model.train()
        model(torch.from_numpy(deployed_input(images(calibration_images))))
        model.eval()
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.momentum = 0.1
                if isinstance(m, torch.nn.BatchNorm1d):  # the embedding's: a variance over a few images is no
                    m.running_var.fill_(m.running_var.mean())  # estimate (some tiny ones would blow float noise up)
                m.running_var.mul_(torch.empty(m.running_var.shape).uniform_(0.5, 2, generator=g))
                m.running_mean.add_(0.1 * torch.randn(m.running_mean.shape, generator=g) * m.running_var.sqrt())
                if m.weight.requires_grad:  # arcface_torch's IResNet freezes features.weight at 1
                    m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.normal_(0, 0.1, generator=g)
                m.num_batches_tracked.fill_(123)
            elif isinstance(m, torch.nn.PReLU):
                m.weight.uniform_(0, 0.5, generator=g)
    return model


def torch_embed(model, n: int) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.from_numpy(deployed_input(images(n)))).numpy()


def numpy_state(model) -> dict:
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


@functools.cache
def embed_fn(graphdef):
    """``f(state, NCHW images) -> embeddings`` for models of ``graphdef``, compiled once per architecture."""
    return jax.jit(lambda state, x: deployed(nnx.merge(graphdef, state))(x))


def jax_embed(model, uint8_images: np.ndarray) -> np.ndarray:
    """The embeddings of ``uint8_images`` by ``deployed(model)``, on one device."""
    graphdef, state = nnx.split(model)
    return np.asarray(embed_fn(graphdef)(state, deployed_input(uint8_images)))


def check_agreement(name, got, want):
    cosine, relative = agreement(got, want)
    print(f"{name}: min cosine {cosine:.9f}, max relative error {relative:.2e}")
    assert cosine >= COSINE and relative <= RELATIVE, (name, cosine, relative)


# the deep IResNets run their blocks in a loop (as under remat: same variables, one block body to compile instead of
# 30 or 60); one of them, and each other family's block kinds, embed as insightface (the others repeat those blocks at
# other depths and widths, through the same mapping)
LOOPED = {"r50", "r100", "r200"}
EMBEDDED = {"r18", "r50", "mbf"}


def convert(name: str):
    """``(torch model, its numpy state dict, the converted jaxcls model)``."""
    model = torch_model(name)
    state = numpy_state(model)
    return model, state, torch_to_jaxcls(state, name, **(dict(remat="full") if name in LOOPED else {}))


converted = functools.cache(convert)  # for the small models that several tests use


@pytest.mark.slow  # whole backbones in PyTorch and XLA
@pytest.mark.usefixtures("torch")
@pytest.mark.parametrize("name", [name for name in ARCFACE_MODELS if not name.startswith("vit")])  # ViTs: below
def test_converted_backbone_embeds_as_insightface(name):
    model, state, converted_model = converted(name) if name in ("r18", "mbf") else convert(name)
    assert list(state) == torch_keys(name)  # the mapping's keys are insightface's, in its order
    if name in EMBEDDED:
        want = torch_embed(model, 4)
        assert np.all(np.isfinite(want)) and np.abs(want).max() > 1
        check_agreement(name, jax_embed(converted_model, images(4)), want)
    back = jaxcls_to_torch(converted_model, name)  # the inverse gives every tensor back, bit for bit
    assert list(back) == list(state)
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            assert back[key].dtype == np.int64 and back[key].shape == () and back[key] == 0
        else:
            assert back[key].dtype == np.float32 and np.array_equal(back[key], value), key


@pytest.mark.slow  # whole backbones in PyTorch and XLA
@pytest.mark.usefixtures("torch")
def test_the_fc_rows_are_permuted_from_nchw_to_nhwc():
    """The IResNet's fc reads the flattened [512, 7, 7] features: a mere transpose of its weight (reading torch's
    (c, h, w) order as jaxcls's (h, w, c)) gives other embeddings; the permutation gives insightface's."""
    model, state, converted_model = converted("r18")
    want = torch_embed(model, 4)
    graphdef, params = nnx.split(converted_model)
    transposed = nnx.from_flat_state([(path, v.replace(jax.numpy.asarray(state["fc.weight"].T))
                                       if path == ("fc", "kernel") else v) for path, v in nnx.to_flat_state(params)])
    naive = np.asarray(embed_fn(graphdef)(transposed, deployed_input(images(4))))
    assert agreement(naive, want)[0] < 0.99
    check_agreement("r18", jax_embed(converted_model, images(4)), want)


@pytest.mark.slow  # whole backbones in PyTorch and XLA
@pytest.mark.parametrize("name", ["r18", "mbf"])
def test_a_jaxcls_backbone_loads_strictly_into_insightface(name, rng, torch):
    """jaxcls → torch on a model whose every variable was changed in jaxcls (so nothing is a copy of a torch
    file): insightface's ``load_state_dict(strict=True)`` takes it and embeds as jaxcls does."""
    _, _, converted_model = converted(name)
    graphdef, params, stats, rest = nnx.split(converted_model, nnx.Param, nnx.BatchStat, ...)
    jitter = lambda x: jax.numpy.asarray(np.asarray(x) * rng.uniform(0.9, 1.1, x.shape).astype(np.float32))
    model = nnx.merge(graphdef, jax.tree.map(jitter, params), jax.tree.map(jitter, stats), rest)
    state = jaxcls_to_torch(model, name)
    fresh = insightface().get_model(name).eval()
    assert list(state) == list(fresh.state_dict())
    fresh.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    check_agreement(name, torch_embed(fresh, 4), jax_embed(model, images(4)))
    assert agreement(torch_embed(fresh, 4), torch_embed(converted(name)[0], 4))[0] < COSINE  # it did change


def test_mapping_errors_name_the_tensors():
    state = recorded("r18")[0]
    to_jaxcls = lambda s, name="r18", **kw: torch_to_jaxcls(s, name, source="b.pth", **kw)
    converted_model = to_jaxcls(state)

    # DataParallel's module. prefix is stripped: the same model
    prefixed = to_jaxcls({f"module.{k}": v for k, v in state.items()})
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), nnx.state(prefixed, nnx.Param, nnx.BatchStat),
                        nnx.state(converted_model, nnx.Param, nnx.BatchStat))
    assert all(jax.tree.leaves(same))

    missing = {k: v for k, v in state.items() if k != "layer2.1.conv1.weight"}
    with pytest.raises(DataError, match=r"^b\.pth: not the state dict of arcface_torch's r18 backbone: 1 missing "
                                        r"key\(s\): layer2\.1\.conv1\.weight$"):
        to_jaxcls(missing)
    with pytest.raises(DataError, match=r"1 unexpected key\(s\): fc\.scale$"):
        to_jaxcls({**state, "fc.scale": np.ones(512, np.float32)})
    with pytest.raises(DataError, match=r"1 missing key\(s\): layer1\.0\.bn1\.num_batches_tracked"):
        to_jaxcls({k: v for k, v in state.items() if k != "layer1.0.bn1.num_batches_tracked"})
    # another model's file: the keys say which
    with pytest.raises(DataError, match=r"missing key\(s\): layer1\.2\.bn1\.weight, .* \(its keys are those of "
                                        r"arcface_torch's r18 \(--model r18\)"):
        to_jaxcls(state, "r34")
    with pytest.raises(DataError, match=r"mbf backbone: \d+ missing key\(s\): layers\.0\.layers\.0\.weight, .*; "
                                        r"187 unexpected key\(s\): conv1\.weight, .* \(its keys are those of "
                                        r"arcface_torch's r18"):
        to_jaxcls(state, "mbf")
    # the FC's (PartialFC) weight instead of the backbone
    with pytest.raises(DataError, match=r"1 unexpected key\(s\): weight \(none of its keys is a backbone's"):
        to_jaxcls({"weight": np.zeros((10, 512), np.float32)})

    wrong = dict(state, **{"layer1.0.conv1.weight": np.zeros((64, 64, 3, 1), np.float32)})
    with pytest.raises(DataError, match=r"^b\.pth: 1 tensor\(s\) of another shape than arcface_torch's r18 has: "
                                        r"layer1\.0\.conv1\.weight: \(64, 64, 3, 1\) in the file, \(64, 64, 3, 3\) "
                                        r"expected$"):
        to_jaxcls(wrong)
    with pytest.raises(DataError, match=r"embedding size: 512 in the file; --num_features\?\): fc\.weight: "
                                        r"\(512, 25088\) in the file, \(256, 25088\) expected"):
        to_jaxcls(state, num_features=256)
    with pytest.raises(DataError, match=r"features\.weight is not all ones"):
        to_jaxcls(dict(state, **{"features.weight": np.full(512, 2, np.float32)}))
    with pytest.raises(DataError, match=r"conv1\.weight: int64 values"):
        to_jaxcls(dict(state, **{"conv1.weight": state["conv1.weight"].astype(np.int64)}))
    for name, reason in [("r2060", "jaxcls has no IResNet-2060"), ("resnet", "not an arcface_torch backbone")]:
        with pytest.raises(ValueError, match=f"cannot convert arcface_torch model '{name}': .*{reason}"):
            to_jaxcls(state, name)


def test_only_the_counterparts_of_arcface_torch_go_back_to_torch():
    from jaxcls.models import get_model
    narrow = nnx.eval_shape(lambda: get_model("r18", 512, width=16))
    with pytest.raises(ValueError, match=r"not jaxcls's counterpart of arcface_torch's r18 .*firsts/0/conv1/kernel: "
                                         r"\(3, 3, 16, 16\), \(3, 3, 64, 64\)"):
        jaxcls_to_torch(narrow, "r18")
    with pytest.raises(ValueError, match="IResNets are 64 wide; this run.s r18 is 16 wide"):
        arcface_name(_with(run_config("r18"), width=16))
    with pytest.raises(ValueError, match=r"arcface_torch's r18 has \(2, 2, 2, 2\) blocks per stage; this run's has "
                                         r"\(1, 1, 1, 2\) \(model_kwargs.stages\)"):
        arcface_name(_with(run_config("r18"), stages=[1, 1, 1, 2]))
    assert arcface_name(_with(run_config("r18"), stages=[2, 2, 2, 2])) == "r18"  # the name's own, as a list
    with pytest.raises(ValueError, match=r"arcface_torch's vit_t has \{'dim': 256, 'depth': 12, 'heads': 8\}; this "
                                         r"run's has \{'dim': 256, 'depth': 2, 'heads': 8\} \(model_kwargs\)"):
        arcface_name(_with(run_config("vit_t"), depth=2))
    assert arcface_name(_with(run_config("vit_t"), depth=12)) == "vit_t"
    # mbf_large is jaxcls's mbf with model_kwargs, which survive a run's config.json
    from jaxcls.config import from_json
    from jaxcls.models import make_model
    config = from_json(run_config("mbf_large").to_json_best_effort())
    assert (config.model, arcface_name(config)) == ("mbf", "mbf_large")
    large = nnx.eval_shape(lambda: make_model(config))
    assert len(large.layers) == 1 + 2 + 1 + 8 + 1 + 12 + 1 + 4 and large.conv_sep.conv.kernel.shape == (1, 1, 512, 512)
    config.data.input_size = 96
    with pytest.raises(ValueError, match="take 112×112 images; this run's take 96×96"):
        arcface_name(config)


def test_each_arcface_vit_masks_as_arcface_torch_trains_it():
    """vit_h masks no token; the "mask_005" ViTs mask 10%, as arcface_torch's forward (it calls random_masking
    without their ratio, whose default is 0.1); the others as their names say."""
    from jaxcls.interop.arcface_torch import jaxcls_model
    from jaxcls.models import get_model
    masked = {}
    for name in ("vit_t", "vit_t_dp005_mask0", "vit_b_dp005_mask_005", "vit_l_dp005_mask_005", "vit_h"):
        model, kwargs = jaxcls_model(name)
        masked[name] = nnx.eval_shape(lambda: get_model(model, 8, **{**kwargs, "depth": 1})).mask_ratio
    assert masked == {"vit_t": 0.1, "vit_t_dp005_mask0": 0.0, "vit_b_dp005_mask_005": 0.1,
                      "vit_l_dp005_mask_005": 0.1, "vit_h": 0.0}


def _with(config, **model_kwargs):
    config.model_kwargs = dict(config.model_kwargs, **model_kwargs)
    return config


@pytest.mark.slow  # whole backbones in PyTorch and XLA
def test_cli_imports_a_pth_and_exports_it_back(tmp_path, torch):
    model, state, _ = converted("r18")
    # a DataParallel model's state dict in a checkpoint as arcface_torch writes it, written by torch
    torch.save({"epoch": 3, "state_dict_backbone": {f"module.{k}": v for k, v in model.state_dict().items()}},
               tmp_path / "checkpoint_gpu_0.pt")
    cli = lambda *args: subprocess.run([sys.executable, "-m", "jaxcls.convert", *map(str, args)], capture_output=True,
                                       text=True, timeout=600)
    done = cli("--torch", tmp_path / "checkpoint_gpu_0.pt", "--model", "r18", "--key", "state_dict_backbone",
               "--workdir", tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {tmp_path / 'run'}: arcface_torch r18 as jaxcls r18, 512-d embeddings, checkpoint 0" in done.stdout

    embedder = Embedder(tmp_path / "run")  # over the 8 devices
    assert (embedder.step, embedder.input_size) == (0, 112)
    check_agreement("r18 Embedder", embedder(images(4)), torch_embed(model, 4))
    backbone, config, step = restore_backbone(tmp_path / "run")
    assert (step, config.model, dict(config.model_kwargs), config.num_features, config.num_classes) == (
        0, "r18", {}, 512, 1)
    # the whole train state (a fresh one-class FC too) restores on any mesh, as jaxcls.eval and resuming read it
    from jaxcls.checkpoint import RunCheckpoints
    from jaxcls.run import build
    checkpoints = RunCheckpoints(tmp_path / "run" / "checkpoints", config.keep_checkpoints)
    restored, position = checkpoints.restore(build(config, with_data=False).abstract_state)  # 8 devices
    checkpoints.close()
    assert int(restored["step"]) == 0 and position == {"global_batches": 0}
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), restored["params"], nnx.state(backbone, nnx.Param))
    assert all(jax.tree.leaves(same))

    done = cli("--to-torch", tmp_path / "back.pth", "--workdir", tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {tmp_path / 'back.pth'}: arcface_torch r18 state dict of {tmp_path / 'run'} step 0" in done.stdout
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    insightface().get_model("r18").load_state_dict(back, strict=True)
    assert list(back) == list(state)
    for key, value in state.items():
        if not key.endswith("num_batches_tracked"):
            assert np.array_equal(back[key].numpy(), value), key

    # errors name the file; a workdir with checkpoints is never written over
    with pytest.raises(DataError, match=rf"^{tmp_path / 'checkpoint_gpu_0.pt'}: not the state dict of "
                                        r"arcface_torch's r34 backbone: .* \(its keys are those of arcface_torch's r18 "
                                        r"\(--model r18\)\)$"):
        import_torch(tmp_path / "checkpoint_gpu_0.pt", "r34", tmp_path / "r34", key="state_dict_backbone")
    assert not (tmp_path / "r34").exists()
    with pytest.raises(CheckpointError, match=r"run already holds checkpoints \(step 0\): convert into a new workdir"):
        write_run(state, "r18", tmp_path / "run")


@pytest.mark.parametrize("args, message", [
    (["--to-torch", "out.pth", "--model", "r50", "--num_features", "128"],
     "--model, --num_features go with --torch, not --to-torch"),
    (["--torch", "in.pth", "--model", "r18", "--step", "3"], "--step goes with --to-torch, not --torch")])
def test_the_cli_refuses_a_flag_of_the_other_direction(args, message, tmp_path):
    """``--to-torch --model r50`` wrote the run's own r18 and ``--torch --step 3`` checkpoint 0, both silently."""
    done = subprocess.run([sys.executable, "-m", "jaxcls.convert", *args, "--workdir", "run"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1 and f"error: {message}" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists() and not (tmp_path / "out.pth").exists()


def test_import_torch_reads_the_file_and_names_it_in_errors(tmp_path):
    save_pth(tmp_path / "fc.pth", {"weight": np.zeros((10, 512), np.float32)})
    with pytest.raises(DataError, match=rf"^{tmp_path / 'fc.pth'}: not the state dict of arcface_torch's r50"):
        import_torch(tmp_path / "fc.pth", "r50", tmp_path / "run")
    save_pth(tmp_path / "mbf.pth", recorded("mbf")[0])
    with pytest.raises(DataError, match=rf"^{tmp_path / 'mbf.pth'}: 5 tensor\(s\) of another shape .*--num_features"):
        import_torch(tmp_path / "mbf.pth", "mbf", tmp_path / "run", num_features=128)
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow  # a PyTorch training and whole backbones in both frameworks
@pytest.mark.usefixtures("torch")
@pytest.mark.skipif(not (GLYPHS / "train.rec").exists(), reason=f"the glyphs data set is not at {GLYPHS}")
def test_a_model_trained_by_arcface_torch_code_imports_and_embeds_as_pytorch(tmp_path):
    """benchmarks/arcface_torch_train.py (arcface_torch's step, here on the CPU) writes a backbone whose weights and
    BatchNorm statistics were trained, not drawn; benchmarks/torch_agreement.py imports it and finds jaxcls's
    embeddings equal to insightface's PyTorch model (the scripts of the GPU fine-tuning demonstration)."""
    from jaxcls.data.pack import main as pack
    pack(["--images", str(GLYPHS), "--classes", "0:4", "--out", str(tmp_path / "a")])
    # jaxcls.embed's Embedder on the 8 simulated devices (mbf's grouped convolutions once took GBs per device there:
    # benchmarks/mbf_convolutions.py); one PyTorch thread: the tests run two workers on two cores
    env = os.environ | {"MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    script = lambda name, *args: subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / name), *map(str, args)],
        capture_output=True, text=True, timeout=600, env=env)
    done = script("arcface_torch_train.py", "--data", tmp_path / "a", "--network", "mbf", "--epochs", 2, "--batch", 16,
                  "--insightface", INSIGHTFACE, "--out", tmp_path / "mbf.pth", "--log", tmp_path / "train.json")
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((tmp_path / "train.json").read_text())
    assert (log["classes"], log["images"], log["steps"]) == (4, 48, 6) and all(map(np.isfinite, log["loss_per_epoch"]))
    trained = load_state_dict(tmp_path / "mbf.pth")
    assert not np.allclose(trained["conv_sep.layers.1.running_var"], 1)  # BatchNorm statistics moved from their start

    done = script("torch_agreement.py", "--pth", tmp_path / "mbf.pth", "--network", "mbf", "--n", 4, "--images",
                  tmp_path / "a" / "train.rec", "--insightface", INSIGHTFACE, "--out", tmp_path / "agree.json")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["embeddings"]: row for row in json.loads((tmp_path / "agree.json").read_text())["rows"]}
    assert len(rows) == 4 and all(row["images"] == 4 for row in rows.values())
    for name, row in rows.items():  # PyTorch's float32 and jaxcls's against PyTorch's float64
        assert row["one_minus_min_cosine"] <= 1 - COSINE and row["max_relative_error"] <= RELATIVE, name


@pytest.mark.slow  # whole backbones in XLA
@pytest.mark.parametrize("name", ["r18", "mbf"])
def test_a_cnn_converts_as_insightface_computes_it(name):
    """insightface's own r18 and mbf (arcface_torch's iresnet.py and mobilefacenet.py, weights drawn by a numpy recipe)
    embedded glyph images (tests/fixtures/make_cnn_reference.py): the same weights, drawn again here without torch,
    convert to a jaxcls model that embeds them as insightface did; read with every kernel's kH and kW swapped (as a
    layout error would), they give other embeddings."""
    state, uint8_images, want = recorded(name)
    assert list(state) == torch_keys(name)  # insightface's keys, in its order
    check_agreement(name, jax_embed(torch_to_jaxcls(state, name), uint8_images), want)
    swapped = {k: v.swapaxes(2, 3) if v.ndim == 4 else v for k, v in state.items()}
    assert agreement(jax_embed(torch_to_jaxcls(swapped, name), uint8_images), want)[0] < 0.999


def test_a_vit_converts_as_insightface_computes_it():
    """insightface's own ViT (arcface_torch's backbones/vit.py, narrow: 32 wide, 2 blocks, 4 heads, 16-d; random
    weights, LayerNorm and BatchNorm values) wrote vit_reference.pth and its embeddings of four glyph images
    (tests/fixtures/make_vit_reference.py): its keys are the mapping's, in order, and the mapping (``vit_layers``, which
    every ViT name uses at its own depth) gives the same embeddings; a ViT whose qkv heads were read in another order
    does not."""
    from jaxcls.interop.arcface_torch import layer_keys, load_torch_state, vit_layers
    from jaxcls.models.vit import VisionTransformer
    state, reference = load_state_dict(FIXTURES / "vit_reference.pth"), np.load(FIXTURES / "vit_reference.npz")
    make = lambda: VisionTransformer(32, 2, 4, num_features=16, rngs=nnx.Rngs(0))
    assert list(state) == layer_keys(vit_layers(2))  # insightface's keys, in its order
    model = load_torch_state(state, "vit_t", make, source="vit_reference.pth", layers=vit_layers(2))
    x = reference["images"].astype(np.float32) / 255 * 2 - 1  # arcface_torch's input, NHWC for jaxcls
    want = reference["embeddings"]
    check_agreement("narrow ViT", np.asarray(model(x)), want)
    # the heads of qkv's output as (head, q/k/v, dim) instead of (q/k/v, head, dim): other embeddings
    shuffled = {k: (v.reshape(3, 4, 8, -1).transpose(1, 0, 2, 3).reshape(v.shape) if k.endswith("qkv.weight") else v)
                for k, v in state.items()}
    other = load_torch_state(shuffled, "vit_t", make, layers=vit_layers(2))
    assert agreement(np.asarray(other(x)), want)[0] < 0.999
    with pytest.raises(DataError, match=r"^vit_reference\.pth: not the state dict of arcface_torch's vit_t backbone: "
                                        r"\d+ missing key\(s\): blocks\.2\.norm1\.weight"):
        load_torch_state(state, "vit_t", make, source="vit_reference.pth")  # vit_t has 12 blocks


@pytest.mark.slow  # a whole vit_t converted both ways
def test_every_arcface_vit_maps_both_ways_bit_for_bit(rng):
    """Each arcface_torch ViT name maps to jaxcls's ViT of its size (keys in torch's order: the model's own parameters,
    then its children); a vit_t with random values goes to torch and back unchanged, and its run config names it."""
    from jaxcls.models import get_model
    from jaxcls.models.vit import SIZES
    for name, (model, kwargs) in ARCFACE_MODELS.items():
        if model.startswith("vit"):
            keys = torch_keys(name)
            assert keys[:4] == ["pos_embed", "mask_token", "patch_embed.proj.weight", "patch_embed.proj.bias"]
            # 11 tensors a block (2 LayerNorms, qkv, proj, fc1, fc2), then the final LayerNorm and the head's
            # linear-BatchNorm-linear-BatchNorm
            assert len(keys) == 4 + 11 * SIZES[model][1] + 2 + 2 * (1 + 5)
            assert keys[-1] == "feature.3.num_batches_tracked"
            config = run_config(name)
            assert (config.model, dict(config.model_kwargs)) == (model, kwargs) and arcface_name(config) == name
    graphdef, params, stats, rest = nnx.split(get_model("vit_t", 512), nnx.Param, nnx.BatchStat, ...)
    draw = lambda x: jax.numpy.asarray(rng.normal(0, 1, x.shape).astype(np.float32))
    model = nnx.merge(graphdef, jax.tree.map(draw, params), jax.tree.map(draw, stats), rest)
    state = jaxcls_to_torch(model, "vit_t")
    assert list(state) == torch_keys("vit_t") and state["feature.0.weight"].shape == (256, 144 * 256)
    back = torch_to_jaxcls(state, "vit_t")
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), nnx.state(back, nnx.Param, nnx.BatchStat),
                        nnx.state(model, nnx.Param, nnx.BatchStat))
    assert all(jax.tree.leaves(same))
    # ViTs of one depth share their keys: a vit_t file given as vit_s or vit_b is named as vit_t's
    with pytest.raises(DataError, match=r"tensor\(s\) of another shape than arcface_torch's vit_s has \(its widths "
                                        r"are those of arcface_torch's vit_t / vit_t_dp005_mask0 \(--model vit_t\)\)"):
        torch_to_jaxcls(state, "vit_s", source="t.pth")
    with pytest.raises(DataError, match=r"missing key\(s\): blocks\.12\..* \(its keys are those of arcface_torch's "
                                        r"vit_t / vit_t_dp005_mask0 \(--model vit_t\)\)$"):
        torch_to_jaxcls(state, "vit_b", source="t.pth")
    # a fine-tuned vit_t with its own drop path goes back as vit_t; another activation has no counterpart
    assert arcface_name(_with(run_config("vit_t"), drop_path=0.2)) == "vit_t"
    with pytest.raises(ValueError, match="ViTs take 9×9 patches and ReLU6; this run's vit_t has 9×9 and gelu"):
        arcface_name(_with(run_config("vit_t"), act="gelu"))
