"""Collectives read from HLO text (both replica-group syntaxes), and the bytes they move between hosts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcls import make_mesh
from jaxcls.plan.hlo import Collective, collectives, cross_host_bytes
from jaxcls.plan.kernels import Kernel, kernels, moved_by_origin

HLO = """
  %ag = f32[64,32]{1,0} all-gather(f32[16,32]{1,0} %x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %ar = (f32[10]{0}, bf16[6]{0}) all-reduce(f32[10]{0} %a, bf16[6]{0} %b), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true
  %rs = f32[8]{0} reduce-scatter(f32[64]{0} %c), channel_id=3, replica_groups={}, dimensions={0}
  %cp = s32[5]{0} collective-permute(s32[5]{0} %d), channel_id=4, source_target_pairs={{0,4},{4,0},{1,2}}
  %add = f32[8]{0} add(f32[8]{0} %e, f32[8]{0} %f)
"""


def test_xla_gpus_mesh_form_of_replica_groups():
    line = "%ar = f32[8]{0} all-reduce-start(f32[8]{0} %x), channel_id=5, replica_groups=mesh['a'=2,'b'=4] {AXES}, x"
    groups = {axes: collectives(line.replace("AXES", axes))[0].groups for axes in ("'b'", "'a'", "'a','b'", "'b':(2)2")}
    assert groups == {"'b'": ((0, 1, 2, 3), (4, 5, 6, 7)), "'a'": ((0, 4), (1, 5), (2, 6), (3, 7)),
                      "'a','b'": ((0, 1, 2, 3, 4, 5, 6, 7),),
                      "'b':(2)2": ((0, 2), (1, 3), (4, 6), (5, 7))}  # b // 2 % 2 varies: b = 0, 2 and 1, 3
    permuted = line.replace("] {", "], device_ids=([2,4]<=[4,2]T(1,0)) {").replace("AXES", "'b'")
    assert collectives(permuted)[0].groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    with pytest.raises(ValueError, match="unrecognised replica_groups syntax"):
        collectives(line.replace("mesh[", "grid[").replace("AXES", "'b'"))


def test_an_asynchronous_collective_counts_its_results_not_its_operands():
    """XLA:GPU's ``-start`` halves carry their operands in their shapes (as in XLA's own tests): an all-gather's
    ``(operand, result)``, a reduce-scatter's ``((operands), result)``, a collective-permute's ``(operand, result,
    u32[], u32[])``; an all-reduce-start's shape is its result alone."""
    text = """
  %ag = (f32[16,32]{1,0}, f32[64,32]{1,0}) all-gather-start(f32[16,32]{1,0} %x), replica_groups={{0,1,2,3}}, x
  %rs = ((f32[64]{0}), f32[16]{0}) reduce-scatter-start(f32[64]{0} %c), replica_groups={{0,1,2,3}}, dimensions={0}
  %cp = (s32[5]{0}, s32[5]{0}, u32[], u32[]) collective-permute-start(s32[5]{0} %d), source_target_pairs={{0,1}}
  %ar = (f32[10]{0}, bf16[6]{0}) all-reduce-start(f32[10]{0} %a, bf16[6]{0} %b), replica_groups={{0,1}}
"""
    ag, rs, cp, ar = collectives(text)
    assert (ag.op, ag.largest, ag.result_bytes) == ("all-gather", 64 * 32, 64 * 32 * 4)
    assert (rs.op, rs.largest, rs.result_bytes) == ("reduce-scatter", 16, 16 * 4)
    assert (cp.op, cp.result_bytes, cp.pairs) == ("collective-permute", 20, ((0, 1),))
    assert (ar.op, ar.result_bytes) == ("all-reduce", 10 * 4 + 6 * 2)


def test_parses_ops_sizes_and_both_group_syntaxes():
    ag, ar, rs, cp = collectives(HLO)
    assert ag == Collective("all-gather", 64 * 32, 64 * 32 * 4, ((0, 1, 2, 3), (4, 5, 6, 7)))
    # iota(4, 2) transposed to (2, 4): [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ar == Collective("all-reduce", 10, 10 * 4 + 6 * 2, ((0, 2, 4, 6), (1, 3, 5, 7)))
    assert rs.op == "reduce-scatter" and rs.groups == () and rs.result_bytes == 32
    assert cp.pairs == ((0, 4), (4, 0), (1, 2)) and cp.result_bytes == 20


def brute_force(c: Collective, hosts):
    """Per host, bytes it must receive: every remote contribution it needs, counted once per host and source host."""
    received = [0] * (max(hosts) + 1)
    for group in c.groups or (tuple(range(len(hosts))),):
        k = len(group)
        n = c.result_bytes * k if c.op == "reduce-scatter" else c.result_bytes
        for host in {hosts[d] for d in group}:
            mine = [d for d in group if hosts[d] == host]
            remote_devices = [d for d in group if hosts[d] != host]
            remote_hosts = {hosts[d] for d in remote_devices}
            gather = len(remote_devices) * n // k  # every remote device's chunk
            scatter = len(mine) * len(remote_hosts) * n // k  # my chunks' partial sums, one per remote host
            received[host] += {"all-gather": gather, "reduce-scatter": scatter, "all-reduce": gather + scatter,
                               "all-to-all": len(mine) * len(remote_devices) * n // k}[c.op]
    return received


@pytest.mark.parametrize("op", ["all-gather", "all-reduce", "reduce-scatter", "all-to-all"])
def test_cross_host_bytes_agree_with_counting_chunks(op, rng):
    devices = 8 * int(rng.integers(1, 3))
    hosts = sorted(rng.integers(0, 3, size=devices).tolist())  # contiguous hosts of random sizes
    ids = rng.permutation(devices)
    size = int(rng.integers(1, 4)) * devices * 4
    c = Collective(op, size, size, (tuple(ids[: devices // 2]), tuple(ids[devices // 2:])))
    assert cross_host_bytes(c, hosts) == brute_force(c, hosts)


def test_one_host_moves_nothing_between_hosts_and_permutes_count_remote_pairs():
    ag, ar, rs, cp = collectives(HLO)
    for c in (ag, ar, rs, cp):
        assert cross_host_bytes(c, [0] * 8) == [0]
    assert cross_host_bytes(cp, [0, 0, 0, 0, 1, 1, 1, 1]) == [20, 20]
    # all-gather of 2048 B shards in two groups of 4: each group within a host moves nothing; each group split
    # 2 + 2 over two hosts brings each host the other host's 2 shards, per group
    assert cross_host_bytes(ag, [0, 0, 0, 0, 1, 1, 1, 1]) == [0, 0]
    assert cross_host_bytes(ag, [0, 0, 1, 1, 0, 0, 1, 1]) == [2 * 2 * 2048, 2 * 2 * 2048]


def test_reads_a_compiled_psum_over_one_mesh_axis():
    mesh = make_mesh(2, 4)
    f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "class"), mesh=mesh, in_specs=P("data", "class"),
                              out_specs=P("data", None)))
    x = jax.ShapeDtypeStruct((2, 4 * 6), jnp.float32, sharding=NamedSharding(mesh, P("data", "class")))
    (found,) = [c for c in collectives(f.lower(x).compile().as_text()) if c.op == "all-reduce"]
    positions = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    rows = [tuple(sorted(positions[d.id] for d in row)) for row in mesh.devices]
    assert sorted(tuple(sorted(g)) for g in found.groups) == sorted(rows) and found.result_bytes == 6 * 4
    assert np.sum(cross_host_bytes(found, [0, 0, 0, 0, 1, 1, 1, 1])) == 0  # each group lives on one host


def test_counts_the_executions_of_a_collective_inside_a_loop():
    mesh = make_mesh(2, 4)

    def body(x):
        return jax.lax.fori_loop(0, 5, lambda i, y: y + jax.lax.psum(jnp.sin(y), "class") * i, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "class"), out_specs=P("data", "class")))
    x = jax.ShapeDtypeStruct((2, 4 * 6), jnp.float32, sharding=NamedSharding(mesh, P("data", "class")))
    found = [c for c in collectives(f.lower(x).compile().as_text()) if c.op == "all-reduce"]
    assert sum(c.count for c in found) == 5, found


def test_kernels_count_the_bytes_they_read_and_write_and_name_their_source_line():
    def body(x, y):  # one fused kernel per iteration, reading x and y and writing x
        return jax.lax.fori_loop(0, 3, lambda i, x: jnp.sin(x) * y, x)

    x = jax.ShapeDtypeStruct((1000,), jnp.float32)
    line = body.__code__.co_firstlineno + 1
    found = [k for k in kernels(jax.jit(body).lower(x, x).compile().as_text()) if k.result_bytes == 4000]
    (fused,) = [k for k in found if k.kind == "fusion"]
    assert fused.count == 3 and fused.moved_bytes == 3 * 4000, fused
    assert fused.origin.endswith(f"/mul (test_hlo.py:{line})"), fused.origin


FUSED = """
%fused_slice (p0: bf16[64,8]) -> f32[1,8] {
  %p0 = bf16[64,8]{1,0} parameter(0)
  %c = f32[64,8]{1,0} convert(%p0)
  ROOT %s = f32[1,8]{1,0} slice(%c), slice={[0:1], [0:8]}
}

%fused_scatter (q0: f32[1000,8], q1: s32[4,1], q2: f32[4,8]) -> f32[1000,8] {
  %q0 = f32[1000,8]{1,0} parameter(0)
  %q1 = s32[4,1]{1,0} parameter(1)
  %q2 = f32[4,8]{1,0} parameter(2)
  ROOT %sc = f32[1000,8]{1,0} scatter(%q0, %q1, %q2), update_window_dims={1}, to_apply=%add
}

ENTRY %main (a: bf16[64,8], t: f32[1000,8], i: s32[4,1], u: f32[4,8]) -> (f32[1,8], f32[1000,8]) {
  %a = bf16[64,8]{1,0} parameter(0)
  %t = f32[1000,8]{1,0} parameter(1)
  %i = s32[4,1]{1,0} parameter(2)
  %u = f32[4,8]{1,0} parameter(3)
  %first = f32[1,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_slice
  %update = f32[1000,8]{1,0} fusion(%t, %i, %u), kind=kInput, calls=%fused_scatter
  ROOT %out = (f32[1,8]{1,0}, f32[1000,8]{1,0}) tuple(%first, %update)
}
"""


def test_fusions_count_what_their_slices_take_and_what_they_scatter_in_place():
    moved = {k.name: k.moved_bytes for k in kernels(FUSED)}
    assert moved == {"first": 8 * 2 + 8 * 4, "update": 4 * 4 + 4 * 8 * 4 + 4 * 8 * 4}, moved


GATHERS = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused_gathers (g0: bf16[1000,8], g1: s32[64,1], g2: s32[4,1]) -> f32[4] {
  %g0 = bf16[1000,8]{1,0} parameter(0)
  %g1 = s32[64,1]{1,0} parameter(1)
  %g2 = s32[4,1]{1,0} parameter(2)
  %tile = bf16[64,8]{1,0} gather(%g0, %g1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
  %rows = bf16[4,8]{1,0} gather(%tile, %g2), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
  %c = f32[4,8]{1,0} convert(%rows)
  %zero = f32[] constant(0)
  ROOT %r = f32[4]{0} reduce(%c, %zero), dimensions={1}, to_apply=%add
}

ENTRY %main (w: bf16[1000,8], i: s32[64,1], j: s32[4,1]) -> f32[4] {
  %w = bf16[1000,8]{1,0} parameter(0)
  %i = s32[64,1]{1,0} parameter(1)
  %j = s32[4,1]{1,0} parameter(2)
  ROOT %targets = f32[4]{0} fusion(%w, %i, %j), kind=kInput, calls=%fused_gathers
}
"""


def test_a_fused_gather_of_gathered_rows_reads_only_the_rows_it_takes():
    """As a fused target-row lookup in a tile's rows: 4 of the tile's 64 gathered rows are read, not the 64."""
    (kernel,) = kernels(GATHERS)
    assert kernel.moved_bytes == 4 * 4 + 4 * 8 * 2 + 64 * 4 + 4 * 4, kernel  # result, 4 rows, both index arrays


ROWS_UPDATE = """
ENTRY %main (i: u32[16], k: pred[16], g: bf16[16,8], r: f32[1], w: bf16[1000,8], m: s8[1000,8], s: f32[1000,1]) -> (bf16[1000,8], s8[1000,8], f32[1000,1]) {
  %i = u32[16]{0} parameter(0)
  %k = pred[16]{0} parameter(1)
  %g = bf16[16,8]{1,0} parameter(2)
  %r = f32[1]{0} parameter(3)
  %w = bf16[1000,8]{1,0} parameter(4)
  %m = s8[1000,8]{1,0} parameter(5)
  %s = f32[1000,1]{1,0} parameter(6)
  ROOT %p = (bf16[1000,8]{1,0}, s8[1000,8]{1,0}, f32[1000,1]{1,0}) custom-call(%i, %k, %g, %r, %w, %m, %s), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{0}: (4, {}), {1}: (5, {}), {2}: (6, {})}, backend_config={grid_x = 2 : i32, name = "rows_update", num_warps = 4 : i32}
}
"""


def test_the_rows_update_kernel_counts_its_index_rows_of_the_arrays_it_updates_in_place():
    (kernel,) = kernels(ROWS_UPDATE)
    inputs = 16 * 4 + 16 + 16 * 8 * 2 + 4  # index, keep, gradient part, scalar: whole
    rows = 2 * 16 * (8 * 2 + 8 + 4)  # weight, int8 momentum and its scales: the index's rows, read and written
    assert kernel.moved_bytes == inputs + rows, kernel
    assert kernel.results == (("bf16", 8000), ("s8", 8000), ("f32", 1000))  # each result of the tuple


def test_moved_bytes_add_up_per_kind_and_source_line_with_gradients_marked():
    found = [Kernel("fusion", "a", "f32", 8, 3, moved_bytes=100, origin="jit(f)/while/body/mul (tiles.py:9)"),
             Kernel("fusion", "b", "f32", 8, 1, moved_bytes=50, origin="jit(f)/while/body/mul (tiles.py:9)"),
             Kernel("GEMM", "c", "bf16", 8, 2, moved_bytes=10,
                    origin="jit(f)/transpose(jvp())/dot_general (tiles.py:9)")]
    assert moved_by_origin(found) == {"fusion: mul (tiles.py:9)": 350, "GEMM: backward dot_general (tiles.py:9)": 20}


SIX = ", ".join(["f32[8]{0}"] * 5) + ", /*index=5*/f32[8]{0}"
SIX_OUTPUTS = f"""
%fused_six (p0: f32[8]) -> ({SIX}) {{
  %p0 = f32[8]{{0}} parameter(0)
  %n = f32[8]{{0}} negate(%p0)
  ROOT %t = ({SIX}) tuple(%n, %n, %n, %n, %n, /*index=5*/%n)
}}

ENTRY %main (a: f32[8]) -> f32[8] {{
  %a = f32[8]{{0}} parameter(0)
  %f = ({SIX}) fusion(%a), kind=kLoop, calls=%fused_six
  ROOT %g = f32[8]{{0}} get-tuple-element(%f), index=5
}}
"""


def test_an_instruction_with_six_or_more_results_is_counted():
    """XLA writes ``/*index=5*/`` into tuple shapes of six or more elements (a horizontal fusion of the optimizer's
    updates, a combined all-reduce): such an instruction was not recognized, its kernel and bytes lost."""
    (fused,) = kernels(SIX_OUTPUTS)
    assert fused.kind == "fusion" and len(fused.results) == 6 and fused.moved_bytes == 32 + 6 * 32, fused
