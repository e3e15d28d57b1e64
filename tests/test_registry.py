"""Forms of a computation chosen by platform: staged with ``lax.platform_dependent``, or, where the caller knows the
platform (``lowered_for``), chosen while tracing so that the other forms are never traced."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcls.eval.evaluator import Evaluator
from jaxcls.losses import sharded_margin_loss
from jaxcls.mesh import make_mesh
from jaxcls.registry import Forms, lowered_for, platform_dependent, platform_of
from jaxcls.run import build
from tiny import get_config


def recording_forms():
    """``(forms, pick, traced)``: two forms of ``x ↦ x·k``, the CPU's ``x·2`` and the others' ``x·3``; ``traced``
    lists the forms as they are traced."""
    forms, traced = Forms("test computation", ("double", "triple")), []

    def form(name, k):
        def f(x):
            traced.append(name)
            return x * k
        return f

    named = {"double": form("double", 2.0), "triple": form("triple", 3.0)}
    return forms, lambda x: forms.pick(named, {"cpu": "double", "default": "triple"})(x), traced


def test_a_known_platform_traces_only_its_form_and_computes_what_the_staged_choice_computes():
    forms, f, traced = recording_forms()
    x = jnp.arange(4.0)
    staged = jax.jit(f)(x)
    assert sorted(traced) == ["double", "triple"]  # platform_dependent traces every branch
    assert "platform_index" in str(jax.make_jaxpr(f)(x))
    traced.clear()

    def known(x):
        with lowered_for(make_mesh(1, 8)):
            return f(x)

    np.testing.assert_array_equal(jax.jit(known)(x), staged)
    np.testing.assert_array_equal(staged, 2 * x)  # the CPU's form
    assert traced == ["double"]
    assert "platform_index" not in str(jax.make_jaxpr(known)(x))
    traced.clear()
    with lowered_for(make_mesh(1, 8)), forms.forced("triple"):  # a form forced wins over the platform's
        np.testing.assert_array_equal(jax.jit(lambda x: f(x))(x), 3 * x)  # traced anew: jit caches by function
    assert traced == ["triple"]


def test_a_known_platform_without_a_branch_or_a_default_is_refused_by_name():
    with lowered_for(make_mesh(1, 8)), pytest.raises(ValueError, match=r"no branch for platform 'cpu' and no "
                                                                        r"default: \['cuda', 'tpu'\]"):
        platform_dependent(jnp.ones(2), cuda=lambda x: x, tpu=lambda x: x)


def test_platform_of_names_platforms_as_platform_dependent_does():
    assert platform_of(jax.devices()[0]) == "cpu"
    gpu = lambda version: SimpleNamespace(platform="gpu", client=SimpleNamespace(platform_version=version))
    assert platform_of(gpu("cuda 12080")) == "cuda"
    assert platform_of(gpu("PJRT C API\nNVIDIA H100 80GB HBM3")) == "cuda"  # a compile-only CUDA device
    assert platform_of(gpu("rocm 60200")) == "rocm"
    assert platform_of(SimpleNamespace(platform="tpu")) == "tpu"


@pytest.mark.parametrize("model", ["r18", "mbf"])
def test_the_train_step_the_loss_and_the_evaluators_forward_stage_no_platform_choice(model):
    """The step (BatchNorm's backward, mbf's grouped convolutions, the FC path's kernels), the sharded loss alone
    and the eval forward are traced for their mesh's platform: no form of another platform is traced
    (``platform_dependent`` traced BatchNorm's two backwards and linearized both: half of a tiny step's tracing)."""
    config = get_config(model=model, sample_rate=0.5)
    if model == "mbf":  # its stem's grouped convolution and depthwise ones, one block a stage
        config.model_kwargs, config.data.input_size = {"blocks": (1, 1, 1, 1)}, 32
    run = build(config, with_data=False)
    images, labels = run.abstract_batch()
    step = str(jax.make_jaxpr(run.train_step)(run.abstract_state, images, labels))
    assert "platform_index" not in step and "custom_vjp_call" in step  # the CPU's BatchNorm backward, written
    state = run.abstract_state
    forward = str(jax.make_jaxpr(Evaluator(run)._embed)(state["params"], state["stats"], images))
    assert "platform_index" not in forward and "conv_general_dilated" in forward
    head, emb = run.train_step.head, jax.ShapeDtypeStruct((run.config.batch_size, run.config.num_features),
                                                                    jnp.float32)
    loss = lambda e, w, y: sharded_margin_loss(e, w, y, head.margin, mesh=head.mesh, class_axes=head.class_axes,
                                               num_classes=head.num_classes, chunk_size=16)
    traced = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(emb, state["weight"], labels))
    assert "platform_index" not in traced
