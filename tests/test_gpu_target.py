"""The train step as XLA:GPU compiles it for 8 H100s (compile-only devices, no GPU): the FC update in place, no
collective that grows with the class count, cuDNN convolutions in the compute dtype, the planner's bytes equal to
``memory_analysis()``; the planner's command line on a GPU target. The tests marked gpu_target need JAX's CUDA
plugin (the plan-gpu extra; .ci/run installs it) and skip without it."""

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxcls.bench import fc_kernels
from jaxcls.losses import rows_backward, rows_stats
from jaxcls.models.layers import bn_backward_forced
from jaxcls.models.mobilefacenet import ConvBlock
from jaxcls.plan import gpu_target
from jaxcls.plan.hlo import collectives, computations
from jaxcls.plan.kernels import kernels
from jaxcls.plan.memory import step_memory
from jaxcls.run import build
from test_benchmarks import SCRIPTS, benchmark, script_env
from tiny import get_config

ROOT = Path(__file__).resolve().parent.parent
ROWS = (2**12, 2**13)  # FC rows per device of the two compiles
D = 32  # tiny.py's embedding size
ARCFACE = dict(name="arcface", s=64.0, m=0.5, straight_through=False)  # the face recipes' margin, not tiny.py's CosFace


def compiled_at(rows: int, fc_state_dtype: str = "same", backward: str | None = None, fc_dtype: str = "bfloat16"):
    """``(run, compiled step)`` of the tiny config with ArcFace, bfloat16 compute, FC weight in ``fc_dtype`` (its
    state in ``fc_state_dtype``), PartialFC 0.5, on 8 H100s; the FC path's kernels as ``--fc-kernels backward``
    picks them (``jaxcls.bench.fc_kernels``; None: the platform's default, the statistics kernel, XLA's GEMMs and the
    update kernel). Compiled once per process for each setting, however the call spells it (``functools.cache``
    keys on the arguments as passed: ``compiled_at(R)`` and ``compiled_at(R, "same")`` compiled twice)."""
    return _compiled_at(rows, fc_state_dtype, backward, fc_dtype)


# The tests that read ``compiled_at``'s programs: one group, so that .ci/run's gpu_target step (``--dist loadgroup``)
# runs them in one worker, which compiles each program once (XLA's compile-only programs cannot be read back from
# JAX's persistent cache, so each worker compiled the programs its share of the tests read)
COMPILED_AT = pytest.mark.xdist_group("compiled_at")


def run_at(rows: int, fc_state_dtype: str = "same", fc_dtype: str = "bfloat16"):
    """The run ``compiled_at`` compiles, built for 8 H100s."""
    config = get_config(num_classes=8 * rows, sample_rate=0.5, chunk_size=1024, precision="bfloat16",
                        fc_dtype=fc_dtype, fc_state_dtype=fc_state_dtype, mesh_data=2, margin=ARCFACE)
    return build(config, gpu_target.gpu_devices("h100", 8), with_data=False)


@functools.cache
def _compiled_at(rows: int, fc_state_dtype: str, backward: str | None, fc_dtype: str):
    with fc_kernels(backward):
        run = run_at(rows, fc_state_dtype, fc_dtype)
        return run, run.compile_step(run.abstract_state, gpu_target.COMPILE_OPTIONS)


@COMPILED_AT
@pytest.mark.slow
@pytest.mark.gpu_target
@pytest.mark.parametrize("fc_dtype,fc_state_dtype", [("bfloat16", "same"), ("bfloat16", "int8"), ("float32", "same")])
def test_the_fc_update_is_in_place_and_no_collective_grows_with_the_classes(fc_dtype, fc_state_dtype):
    """In the default GPU form, the update kernel after XLA's GEMMs. (XLA's form, which GPUs run for rows replicated
    over the data replicas, was held to this as the GPU default until the fifth lease; XLA:CPU's tests hold it.)"""
    (small_run, small), (big_run, big) = (compiled_at(rows, fc_state_dtype, None, fc_dtype) for rows in ROWS)
    assert big_run.mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
    more_rows = ROWS[1] - ROWS[0]
    grown = {part: step_memory(big_run, big).parts[part] - step_memory(small_run, small).parts[part]
             for part in ("FC weight", "FC optimizer state")}
    row = D * jnp.dtype(fc_dtype).itemsize
    momentum_row = row if fc_state_dtype == "same" else D + 4  # as the weight, or int8 and a float32 scale
    assert grown == {"FC weight": more_rows * row, "FC optimizer state": more_rows * momentum_row}
    # the weight and momentum are updated in place: the temporaries hold no FC-sized copy (XLA:CPU's do,
    # 2 × 64 B per row here); what grows is a few bytes per row of PartialFC's sampling, or nothing: XLA's buffer
    # assignment may pack the bigger program's temporaries a few hundred bytes tighter (-256 B seen)
    extra = big.memory_analysis().temp_size_in_bytes - small.memory_analysis().temp_size_in_bytes
    assert -4096 <= extra <= 4 * more_rows, extra
    ops = [collectives(c.as_text()) for c in (small, big)]
    assert ops[0] == ops[1] and len(ops[0]) >= 4  # every collective the same size at twice the classes
    assert {c.op for c in ops[0]} >= {"all-gather", "all-reduce"}
    assert all(c.groups for c in ops[0])  # XLA:GPU's mesh form of replica groups read


@COMPILED_AT
@pytest.mark.slow
@pytest.mark.gpu_target
def test_the_tile_loop_writes_no_tile_sized_array():
    """In the FC step's tile loops no kernel writes a [T, D] array: no normalized copy of the rows (the cosines are
    scaled by each row's inverse norm; the copy cost 4.4 of the 28.8 KB per sampled row that the step moved at batch
    128, D = 512, benchmarks/fc_bytes_per_row.py), no gathered copy and no gradient of them (jaxcls.losses' row kernels
    read the rows by index and form their gradient where they update them); nor an [N, T] array of logits, their
    gradient or their statistics' terms (the kernels keep them on chip)."""
    text = compiled_at(ROWS[0], backward="pallas")[1].as_text()
    bodies, _ = computations(text)
    # chunk_size T = 1024, D = 32, N = 32 embeddings: [T, D] (or [T, 1, D]) and [N, T]
    tile = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[(?:1024,(?:1,)?32|32,1024)\]\S* (\w+)\(")

    def computed(kernel):  # its [T, D] and [N, T] results (fusion roots seen through bitcasts)
        line = next(line for line in text.splitlines() if re.match(rf"\s*(?:ROOT )?%{re.escape(kernel.name)} = ", line))
        if kernel.kind != "fusion":
            return [kernel.kind] if tile.match(line) else []
        body = bodies[re.search(r"calls=%?([\w.\-]+)", line).group(1)]
        instruction = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\(")
        ops = {m.group(1): (m.group(2), line) for line in body if (m := instruction.match(line))}
        root = next(l for l in body if l.lstrip().startswith("ROOT"))
        outputs = re.findall(r"%([\w.\-]+)", root.split("(", 1)[1]) if " tuple(" in root else [root.split()[1][1:]]
        made = []
        for name in outputs:
            op, producer = ops[name]
            while op == "bitcast":
                name = re.search(r"bitcast\(%([\w.\-]+)", producer).group(1)
                op, producer = ops[name]
            if tile.match(producer):
                made.append(f"fusion {op}")
        return made

    in_loops = [k for k in kernels(text) if k.count > 1]
    written = [(made, k.origin) for k in in_loops for made in computed(k)]
    assert not written, written
    for kernel in ("rows_stats", "rows_embedding_grad", "rows_update"):  # the kernels are in the loops
        assert any(f"/{kernel}/pallas_call" in k.origin for k in in_loops), kernel


def assert_once_per_tile_and_in_place(text: str, found, names: tuple[str, ...]):
    """Each named Pallas kernel is one kernel run once per tile (count > 1), and every rows_update launch aliases
    its outputs to its operands (the rows written in place)."""
    for kernel in names:
        ours = [k for k in found if f"/{kernel}/pallas_call" in k.origin]
        assert len(ours) == 1 and ours[0].count > 1, (kernel, ours)
    launches = [line for line in text.splitlines() if 'name = "rows_update"' in line]
    assert launches and all("output_to_operand_aliasing" in line for line in launches)


@COMPILED_AT
@pytest.mark.slow
@pytest.mark.gpu_target
@pytest.mark.parametrize("fc_state_dtype", ["same", "int8"])
def test_the_fc_rows_are_read_by_index_and_updated_by_kernels_that_touch_each_once(fc_state_dtype):
    """On a GPU the statistics pass is jaxcls.losses.rows_stats' Triton kernel and the backward rows_backward's two,
    each run once per tile: no gathered copy of the rows or of the optimizer state, no scatter, no row gradient
    written, the update in place (the backward's kernels forced: the default is the update kernel alone, next test)."""
    text = compiled_at(ROWS[0], fc_state_dtype, backward="pallas")[1].as_text()
    found = kernels(text)
    assert_once_per_tile_and_in_place(text, found, ("rows_stats", "rows_embedding_grad", "rows_update"))
    in_tile_loops = [k.origin for k in found if k.count > 1 and ("/scatter" in k.origin or "/gather" in k.origin)]
    assert not in_tile_loops, in_tile_loops


@COMPILED_AT
@pytest.mark.slow
@pytest.mark.gpu_target
def test_the_update_kernel_alone_updates_the_rows_in_place_after_xlas_gemms():
    """By default on a GPU (rows_backward.KERNEL_ON_CUDA, GEMMS_IN_KERNELS off: ``--fc-kernels pallas_update``), the
    statistics are rows_stats' kernel, XLA's GEMMs form the embeddings' and the rows' gradients from one gathered
    copy of the weight's rows, and rows_update, once per tile, reads the rows and their momentum by index and writes
    them in place: no scatter and no gathered momentum in the tile loops (XLA's form gathers both and scatters each,
    re-reading the gathered rows: 18.1 KB a sampled row at batch 128, D = 512, bfloat16, against this form's 13.1,
    with CosFace; benchmarks/fc_bytes_per_row.py --margin cosface). Its gather and GEMMs are XLA's form's, whose
    temporaries test_the_fc_update_is_in_place_and_no_collective_grows_with_the_classes holds to the class count."""
    text = compiled_at(ROWS[0])[1].as_text()
    found = kernels(text)
    assert_once_per_tile_and_in_place(text, found, ("rows_stats", "rows_update"))
    assert 'name = "rows_embedding_grad"' not in text
    in_loops = [k for k in found if k.count > 1]
    assert not [k.origin for k in in_loops if "/scatter" in k.origin]
    gathered = sum(k.moved_bytes for k in in_loops if "gather" in k.name)  # fusions named by the ops they fuse
    tile = 1024 * D * 2  # chunk_size rows of the bfloat16 weight
    # the weight's rows read and their copy written, alone (0: XLA named the fusion otherwise, or fused it)
    assert tile * 2 <= gathered < tile * 3, gathered / tile
    # the rows' product [T, D] in the compute dtype, written for the kernel (the other GEMMs write float32 arrays)
    products = [k.name for k in in_loops if k.kind == "GEMM" and k.dtype == "bf16" and k.result_bytes == tile]
    assert len(products) == 1, products


def lowered_at(rows: int, backward: str | None) -> str:
    """The StableHLO of ``compiled_at``'s program before XLA compiles it (what ``--fc-kernels`` chooses is chosen
    while tracing: lowering shows it in seconds, where compiling took ~40)."""
    with fc_kernels(backward):
        run = run_at(rows)
        return run.jit_step().lower(run.abstract_state, *run.abstract_batch()).as_text()


@pytest.mark.gpu_target
def test_the_fc_backward_on_a_gpu_takes_xlas_form_where_forced():
    """``--fc-kernels xla`` (jaxcls.bench.fc_kernels): the statistics and the backward in XLA's form, which scatters
    the updated rows, no kernel; the platform's form has the statistics and update kernels and fewer scatters."""
    default, forced = (lowered_at(ROWS[0], backward) for backward in (None, "xla"))
    assert 'name = "rows_stats"' in default and 'name = "rows_update"' in default
    assert "triton" not in forced and "rows_" not in forced
    assert forced.count("stablehlo.scatter") > default.count("stablehlo.scatter")


@pytest.mark.slow
@pytest.mark.gpu_target
def test_the_fc_path_moves_at_most_8_kb_per_sampled_row(tmp_path):
    """benchmarks/fc_bytes_per_row.py, run as a user runs it, for a bfloat16 FC state at batch 128, D = 512 on one
    H100: 6.5 KB per sampled row with ArcFace (6.7 with CosFace), the goal 8 and the floor 5 (counted with CosFace
    until 2026-11-28: 28.8 before the loss scaled its cosines by inverse norms, selected the margin's target logit
    elementwise and took its softmax statistics in one reduction: 20.9; then the rows update became one kernel: 16.0;
    then the statistics pass: 13.1; then the backward two kernels that recompute the cosines from the rows read by
    index, the update forming the rows' gradient on chip). The script's only test: its JSON holds what
    test_benchmarks asks of every script's."""
    out = tmp_path / "bytes.json"
    # the looped kernels' count (the default GPU form, the update kernel after XLA's GEMMs, moves 13.2 KB; XLA's 18.1
    # with CosFace)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fc_bytes_per_row.py"), "--fc-dtype", "bfloat16",
                           "--fc-kernels", "pallas", "--out", str(out)], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["environment"]["backend"] == "cpu"  # compile-only: no GPU was started
    assert SCRIPTS["fc_bytes_per_row.py"] <= row.keys()
    assert (row["fc_dtype"], row["batch"], row["classes"], row["fc_kernels"]) == ("bfloat16", 128,
                                                                                  [4_000_000, 16_000_000], "pallas")
    assert 5 < row["kb_per_sampled_row"] <= 8, row["kb_per_sampled_row"]


@pytest.mark.gpu_target
@pytest.mark.parametrize("optimizer,weight,state,embeddings,margin,rounding", [
    ("sgd", "bfloat16", "bfloat16", "bfloat16", "arcface", "nearest"),
    ("sgd", "bfloat16", "int8", "float16", "sphereface", "nearest"),
    ("sgd", "float32", "float32", "bfloat16", "cosface", "nearest"),
    ("adamw", "float32", "float32", "float16", "arcface", "nearest"),
    ("sgd", "bfloat16", "bfloat16", "bfloat16", "cosface", "stochastic")])
@pytest.mark.parametrize("variant", list(rows_backward.VARIANTS))
def test_the_row_kernels_compile_for_an_h100_at_full_size(optimizer, weight, state, embeddings, margin, rounding,
                                                          variant):
    """Each FC row kernel (statistics, embeddings' gradient, update; or the update alone after XLA's GEMMs) through
    Triton for an H100 at D = 512, a 65,536-row tile, N = 128, for each optimizer rule, storage, compute dtype, margin
    family (acos for SphereFace) and the weight's rounding (stochastic: integer hashing): a rule or margin with an
    operation Triton lacks, or a block too large for an SM, fails here rather than in a lease."""
    with rows_backward.variant(variant):
        compiled = benchmark("fc_kernels").compile_row_kernels(gpu_target.gpu_devices("h100", 1)[0], optimizer,
                                                               weight, state, embeddings, margin, rounding)
    text = compiled.as_text()
    (gemms_in_kernels,) = rows_backward.VARIANTS[variant]
    expected = {"rows_stats", "rows_update"} | ({"rows_embedding_grad"} if gemms_in_kernels else set())
    assert {kernel for kernel in ("rows_stats", "rows_embedding_grad", "rows_update")
            if f'name = "{kernel}"' in text} == expected


@pytest.mark.gpu_target
def test_the_whole_loss_writes_one_float32_array_of_products_and_moves_20_gib():
    """sharded_margin_loss without chunks (ArcFace, N = 512, C = 1M, D = 512, bfloat16 embeddings, float32 weight)
    compiled for an H100: the forward keeps the GEMM's [N, C] float32 products, the only float32 [N, C] array any of
    its kernels writes and its only temporary of that size, and the statistics and the backward each read it once:
    its kernels move 20.1 GiB. Autodiff of the margin logits and
    class_parallel_cross_entropy kept the logits and wrote their gradient and the margin's (29.1 GiB, 2.0 arrays of
    temporaries); with the margin's target logit evaluated at every element the forward wrote the logits for the
    statistics to read (24.1 GiB, 1.5 arrays)."""
    n, c = 512, 1 << 20
    compiled = benchmark("fc_bytes_per_row").compiled_loss_alone(n, c, None, gpu_target.gpu_devices("h100", 1)[0])
    assert compiled.memory_analysis().temp_size_in_bytes < 1.25 * n * c * 4
    program = kernels(compiled.as_text())
    written = [k.kind for k in program if ("f32", n * c) in k.results]  # [C, D] has as many elements: D = N
    assert sorted(written) == ["GEMM", "fusion"], written  # the products, then the rows' float32 gradient (an output)
    moved = sum(k.moved_bytes * k.count for k in program)
    assert moved < 21 * 2**30, moved / 2**30


CHUNKED_LOSS = pytest.mark.xdist_group("chunked_loss")  # the tests that read chunked_loss's program: one worker


@functools.cache
def chunked_loss() -> str:
    """The HLO of sharded_margin_loss with ArcFace in chunks of 131,072 rows (C = 1M, N = 512, D = 512, float32
    weight, bfloat16 embeddings) compiled for an H100 (benchmarks/fc_bytes_per_row.py --loss-alone's)."""
    device = gpu_target.gpu_devices("h100", 1)[0]
    return benchmark("fc_bytes_per_row").compiled_loss_alone(512, 1 << 20, 131_072, device).as_text()


@CHUNKED_LOSS
@pytest.mark.gpu_target
def test_the_margins_gradient_is_one_pass_over_the_tiles_cosines():
    """ArcFace's target logit, evaluated at every element of a tile's ``[N, T]`` cosines, kept XLA:GPU from fusing the
    cosines' gradient into the pass that rounds it for the GEMMs and sums it over the batch: the backward wrote it as a
    float32 ``[N, T]`` array and read it back (6 of the chunked loss's 28.7 GiB; in the step 1.5 KB a sampled row at
    batch 128, 5.9 at 512, bfloat16, benchmarks/fc_bytes_per_row.py). Taken at each embedding's target cosine
    (``tiles.cosine_grads``' ``target_cos``), the margin leaves one float32 ``[N, T]`` array a tile among all the
    results of the tile loop's kernels: the cosines the GEMM recomputes. (At the tiny sizes of ``compiled_at`` XLA
    fuses otherwise: it writes the batch's terms of the sum for a reduction of their own.)"""
    tile = ("f32", 512 * 131_072)
    written = [(k.name, k.kind) for k in kernels(chunked_loss()) if k.count > 1 and tile in k.results]
    assert len(written) == 1 and written[0][1] == "GEMM", written


@CHUNKED_LOSS
@pytest.mark.gpu_target
def test_the_chunked_loss_never_reads_back_the_gradient_it_fills():
    """sharded_margin_loss with ArcFace in chunks of 131,072 rows (C = 1M, N = 512, D = 512, float32 weight, XLA's
    backward, the GPUs' form for a gradient written) compiled for an H100: its kernels read and write 22.7 GiB; 24.7
    in the update kernel's form, which reads back the rows a tile does not keep; 28.7 with the margin evaluated at
    every element of each tile's cosines (their gradient written as a float32 [N, T] array and read back); 34.7 when
    each tile's scatter of the weight's gradient selected between the new rows and the old ones it read back."""
    text = chunked_loss()
    assert 'name = "rows_update"' not in text
    moved = sum(k.moved_bytes * k.count for k in kernels(text))
    assert moved < 23.5 * 2**30, moved / 2**30


@pytest.mark.gpu_target
@pytest.mark.parametrize("variant", list(rows_backward.VARIANTS))
def test_each_row_kernels_launch_and_registers_are_read_from_its_compile(variant):
    """jaxcls.plan.ptx on the row kernels' H100 program (benchmarks/fc_kernels.py --registers): each kernel's grid and
    warps are the modules' settings, and ptxas reports registers within an SM thread's 255; the embeddings' gradient
    is a kernel only in the looped variant."""
    with rows_backward.variant(variant):
        rows = {row["kernel"]: row for row in benchmark("fc_kernels").register_rows({}, n=128)}
    looped = variant == "pallas"
    assert set(rows) == {"rows_stats", "rows_update"} | ({"rows_embedding_grad"} if looped else set())
    update = rows["rows_update"]
    assert (update["programs"], update["warps"]) == (65_536 // rows_backward.UPDATE_BLOCK_ROWS,
                                                     rows_backward.UPDATE_WARPS)
    assert rows["rows_stats"]["warps"] == rows_stats.WARPS
    assert not looped or rows["rows_embedding_grad"]["warps"] == rows_backward.GRAD_WARPS
    assert all(0 < row["registers"] <= 255 and row["programs_per_sm"] >= 1 for row in rows.values())


@pytest.mark.gpu_target
@pytest.mark.parametrize("backward,moves", [("written", (8, 8.1)), ("autodiff", (9, 10)), (None, (9, 10))])
def test_batchnorm_and_its_prelu_move_8_activations_a_layer_written_9_by_autodiff(backward, moves):
    """Per BatchNorm layer of a chain of mbf ConvBlocks (conv, BN, PReLU; the last without PReLU), in bfloat16 on
    an H100, the kernels move 8 activations' bytes: 3 in the forward (x read for the statistics, read again and the
    output written), 5 in the backward (x and the output's gradient read for the sums, read again and x's gradient
    written), where XLA may fuse a forward pass with a backward one. Autodiff of the same forward, which GPUs take
    by default (None; XLA:GPU reduces the written form's stacked sums with scalar loads), writes PReLU's gradient
    and re-reads it: 9.4 a layer here."""
    batch, size, channels = 256, 16, 64
    model = nnx.Sequential(*(ConvBlock(channels, channels, linear=i == 2, dtype=jnp.bfloat16, bn_groups=1,
                                       rngs=nnx.Rngs(i)) for i in range(3)))
    graphdef, params, stats = nnx.split(model, nnx.Param, ...)

    def step(params, stats, x, cotangent):  # the output and the parameters' gradient for its cotangent
        apply = lambda params, stats: nnx.merge(graphdef, params, stats)(x)  # stats enter as primals (NNX)
        out, pullback = jax.vjp(apply, params, stats)
        return out, pullback(cotangent)

    sharding = jax.sharding.SingleDeviceSharding(gpu_target.gpu_devices("h100", 1)[0])
    x = jax.ShapeDtypeStruct((batch, size, size, channels), jnp.bfloat16)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), (params, stats, x, x))
    with bn_backward_forced(backward):
        compiled = jax.jit(step).lower(*args).compile(gpu_target.COMPILE_OPTIONS)
    activation = batch * size * size * channels * 2
    moved = sum(k.count * k.moved_bytes for k in kernels(compiled.as_text()) if "layers.py" in k.origin)
    assert moves[0] <= moved / 3 / activation < moves[1], moved / 3 / activation  # 8.05: the reductions' partials


@COMPILED_AT
@pytest.mark.slow
@pytest.mark.gpu_target
def test_convolutions_are_cudnn_calls_in_the_compute_dtype():
    hlo = compiled_at(ROWS[0])[1].as_text()
    convolutions = [line for line in hlo.splitlines() if 'custom_call_target="__cudnn$conv' in line]
    # forward, input and filter gradients of each of tiny.py's 15 convolutions (its stem's input gradient unneeded)
    assert len(convolutions) >= 3 * 15 - 1, len(convolutions)
    dtype = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = \(?(\w+)\[", hlo, re.MULTILINE))  # of each result
    for line in convolutions:
        name, operands = re.search(r"(%[\w.\-]+) = .*? custom-call\((.*?)\), window", line).groups()
        assert [dtype[name]] + [dtype[o] for o in operands.split(", ")] == ["bf16"] * 3, line
    assert not re.search(r"= \S+ convolution\(", hlo)  # none left to XLA's own (slow) convolution emitter


@COMPILED_AT
@pytest.mark.slow
@pytest.mark.gpu_target
def test_the_plans_bytes_are_xla_gpus_memory_analysis():
    run, compiled = compiled_at(ROWS[0])
    memory, stats = step_memory(run, compiled), compiled.memory_analysis()
    assert memory.platform == "gpu"
    assert memory.total == (stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes
                            - stats.alias_size_in_bytes)


@pytest.mark.slow
@pytest.mark.gpu_target
def test_the_planner_on_a_gpu_target(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "jaxcls.plan", "--config", "tests/tiny.py", "--target", "h100",
                           "--devices", "16", "--config.batch_size=64", "--json", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled by XLA:GPU (CUDA plugin " in proc.stdout
    assert "for 16 × NVIDIA H100 80GB HBM3 on 2 hosts" in proc.stdout
    assert "compile-only: nothing was autotuned" in proc.stdout
    plan = json.loads(out.read_text())
    assert plan["device_memory"] == 84_942_979_072 and plan["usable_bytes"] == int(0.75 * 84_942_979_072)
    assert plan["hosts"] == 2 and plan["devices"] == 16 and plan["total_bytes"] == sum(plan["parts"].values())


@pytest.mark.gpu_target
def test_fields_this_jaxlib_does_not_know_are_dropped(monkeypatch):
    text = gpu_target.target_config("a100-80gb")
    newer = text.replace("  core_count: 108\n", "  core_count: 108\n  a_field_from_the_future: 7\n"
                         "  another_one {\n    x: 1\n  }\n")
    monkeypatch.setattr(gpu_target, "target_config", lambda name: newer)
    devices = gpu_target.gpu_devices("a100-80gb", 2)
    assert len(devices) == 2 and devices[0].device_kind == "NVIDIA A100-SXM4-80GB"


def test_a_missing_plugin_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(gpu_target, "PLUGINS", ("jax_plugins.not_a_plugin",))
    with pytest.raises(gpu_target.MissingPlugin, match=re.escape(
            f"pip install 'jax-cuda12-plugin=={jax.__version__}' 'jax-cuda12-pjrt=={jax.__version__}' "
            "nvidia-cuda-nvcc-cu12")):
        gpu_target.gpu_devices("h100", 1)


def test_targets_and_their_memory():
    assert gpu_target.device_memory("h100") == 84_942_979_072  # the target's description, under the card's own
    assert "device_memory_size: 151397597184" in gpu_target.target_config("h200")  # over what an H200 reports:
    assert gpu_target.device_memory("h200") == 143_771 * 2**20
    with pytest.raises(ValueError, match="unknown GPU target 'h800'; choose one of h100, h200, a100-80gb"):
        gpu_target.target_config("h800")
    with pytest.raises(ValueError, match="12 GPUs: give at most 8 .* or a multiple of 8"):
        gpu_target.gpu_devices("h100", 12)


def test_a_gemm_without_triton_tiles_falls_back_to_cublas_and_other_errors_stay():
    class Run:  # a run whose compile with Triton GEMMs fails with ``error``, as vit_t's did for an H100
        def __init__(self, error):
            self.error, self.calls = error, []

        def compile_step(self, state, options):
            self.calls.append(options)
            if options.get("xla_gpu_enable_triton_gemm", True):
                raise jax.errors.JaxRuntimeError(self.error)
            return "compiled"

    run = Run("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot.469 = bf16[16512,256]")
    assert gpu_target.compile_step(run, None) == ("compiled", True)
    assert run.calls == [gpu_target.COMPILE_OPTIONS, gpu_target.WITHOUT_TRITON_GEMMS]
    assert gpu_target.WITHOUT_TRITON_GEMMS["xla_gpu_enable_cub_radix_sort"] is False
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        gpu_target.compile_step(Run("RESOURCE_EXHAUSTED: out of memory"), None)
