"""Wire-byte accounting: analytic ring costs and collectives parsed from compiled HLO."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from commjax import accounting as acc
from commjax.accounting import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_PERMUTE,
    REDUCE_SCATTER,
    CommunicationPlan,
    Transfer,
    collective_bytes,
    hlo_collective_dtypes,
    parse_hlo_collectives,
    ring_bytes,
)

N = 8


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= N, "tests need 8 forced CPU devices (see conftest.py)"
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def mesh2d():
    return jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto, AxisType.Auto))


def smap(f, mesh, in_specs=P("data"), out_specs=P("data")):
    return jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


# ------------------------------------------------------------------- analytic formulas


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_ring_bytes_formulas(n):
    s = 1200
    assert ring_bytes(ALL_REDUCE, s, n) == pytest.approx(2 * (n - 1) / n * s)
    assert ring_bytes(ALL_GATHER, s, n) == pytest.approx((n - 1) * s)
    assert ring_bytes(REDUCE_SCATTER, s, n) == pytest.approx((n - 1) / n * s)
    assert ring_bytes(ALL_TO_ALL, s, n) == pytest.approx((n - 1) / n * s)
    assert ring_bytes(COLLECTIVE_PERMUTE, s, n) == pytest.approx(s)
    # all-reduce == reduce-scatter of S + all-gather of S/N
    assert ring_bytes(ALL_REDUCE, s, n) == pytest.approx(
        ring_bytes(REDUCE_SCATTER, s, n) + ring_bytes(ALL_GATHER, s / n, n)
    )


def test_ring_bytes_group_of_one_and_errors():
    for kind in acc.COLLECTIVE_KINDS:
        assert ring_bytes(kind, 4096, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind"):
        ring_bytes("all-sum", 10, 4)
    with pytest.raises(ValueError):
        ring_bytes(ALL_REDUCE, -1, 4)


def test_plan_totals():
    """Steady-state average, peak, the static (compiled) count and the ratio of a plan
    with a per-step, a periodic and an occasional transfer."""
    plan = CommunicationPlan("t", 8, (Transfer("a", "all-reduce", 100.0), Transfer("b", "all-gather", 400.0, 4),
                                      Transfer("c", "all-reduce", 7.0, 0)), baseline_bytes=1000.0)
    assert plan.bytes_per_step == 200.0 and plan.peak_bytes == 500.0 and plan.compiled_bytes == 507.0
    assert plan.compression_ratio == 5.0 and plan.bytes_of("b") == 400.0
    assert "every 4 steps" in plan.table() and "occasional" in plan.table() and "5.00x" in plan.summary()


# ------------------------------------------------------------- compiled shard_map HLO


def test_psum_f32(mesh):
    f = smap(lambda x: lax.psum(x, "data"), mesh)
    rep = collective_bytes(f, jnp.ones(N * 1000, jnp.float32))
    assert len(rep.collectives) == 1
    (c,) = rep.collectives
    assert (c.kind, c.dtypes, c.operand_bytes, c.group_size) == (ALL_REDUCE, ("f32",), 4000, 8)
    assert c.ring_bytes == pytest.approx(2 * 7 / 8 * 4000)
    assert rep.total_ring_bytes == pytest.approx(ring_bytes(ALL_REDUCE, 4000, 8))
    assert rep.total_operand_bytes == 4000
    assert rep.by_kind() == {ALL_REDUCE: pytest.approx(7000.0)}
    assert not c.in_loop
    assert "all-reduce" in rep.table() and "TOTAL" in rep.table()


def test_unjitted_function_is_jitted(mesh):
    f = jax.shard_map(lambda x: lax.psum(x, "data"), mesh=mesh, in_specs=P("data"),
                      out_specs=P("data"), check_vma=False)
    rep = collective_bytes(f, jnp.ones(N * 10, jnp.float32))
    assert [c.kind for c in rep.collectives] == [ALL_REDUCE]


def test_all_gather_u8_tiled(mesh):
    n = 100
    f = smap(lambda x: lax.all_gather(x, "data", tiled=True), mesh)
    rep = collective_bytes(f, jnp.ones(N * n, jnp.uint8))
    (c,) = rep.collectives
    assert (c.kind, c.dtypes, c.operand_bytes, c.group_size) == (ALL_GATHER, ("u8",), n, 8)
    assert c.ring_bytes == pytest.approx(7 * n)


def test_all_to_all_u32_tiled(mesh):
    n = 64  # per-device u32 words
    f = smap(lambda x: lax.all_to_all(x, "data", 0, 0, tiled=True), mesh)
    rep = collective_bytes(f, jnp.ones(N * n, jnp.uint32))
    (c,) = rep.collectives
    assert c.kind == ALL_TO_ALL and c.group_size == 8
    assert set(c.dtypes) == {"u32"}
    assert c.operand_bytes == 4 * n  # summed over the variadic operands XLA splits it into
    assert c.ring_bytes == pytest.approx(7 / 8 * 4 * n)


def test_psum_scatter(mesh):
    f = smap(lambda x: lax.psum_scatter(x, "data", tiled=True), mesh)
    rep = collective_bytes(f, jnp.ones(N * 1000, jnp.float32))
    (c,) = rep.collectives
    assert (c.kind, c.operand_bytes, c.group_size) == (REDUCE_SCATTER, 4000, 8)
    assert c.ring_bytes == pytest.approx(7 / 8 * 4000)


def test_ppermute(mesh):
    perm = [(i, (i + 1) % N) for i in range(N)]
    f = smap(lambda x: lax.ppermute(x, "data", perm), mesh)
    rep = collective_bytes(f, jnp.ones(N * 250, jnp.float32))
    (c,) = rep.collectives
    assert (c.kind, c.operand_bytes, c.group_size) == (COLLECTIVE_PERMUTE, 1000, 8)
    assert c.ring_bytes == pytest.approx(1000)


def test_sub_axis_group_sizes(mesh2d):
    spec = P(("a", "b"))
    f = smap(lambda x: (lax.psum(x, "b"), lax.psum(x * 2, "a")), mesh2d, spec, (spec, spec))
    rep = collective_bytes(f, jnp.ones(N * 100, jnp.float32))
    assert sorted(c.group_size for c in rep.collectives) == [2, 4]
    expected = ring_bytes(ALL_REDUCE, 400, 4) + ring_bytes(ALL_REDUCE, 400, 2)
    assert rep.total_ring_bytes == pytest.approx(expected)


def test_two_psums_of_different_dtypes(mesh):
    def f(x):
        return lax.psum(x, "data"), lax.psum(x.astype(jnp.int32), "data")

    rep = collective_bytes(smap(f, mesh, out_specs=(P("data"), P("data"))),
                           jnp.ones(N * 1000, jnp.float32))
    assert sorted(d for c in rep.collectives for d in c.dtypes) == ["f32", "s32"]
    assert rep.total_operand_bytes == 8000
    assert rep.total_ring_bytes == pytest.approx(2 * ring_bytes(ALL_REDUCE, 4000, 8))


def test_combined_all_reduce_is_summed(mesh):
    # XLA's all-reduce combiner merges same-dtype psums into one tuple-shaped op.
    f = smap(lambda x: lax.psum((x, 2 * x), "data"), mesh, out_specs=(P("data"), P("data")))
    rep = collective_bytes(f, jnp.ones(N * 1000, jnp.float32))
    assert rep.total_operand_bytes == 8000
    assert rep.total_ring_bytes == pytest.approx(2 * ring_bytes(ALL_REDUCE, 4000, 8))


def test_collective_in_fori_loop_is_flagged(mesh):
    def f(x):
        return lax.fori_loop(0, 3, lambda i, c: lax.psum(c, "data") * 0.5, x)

    rep = collective_bytes(smap(f, mesh), jnp.ones(N * 1000, jnp.float32))
    (c,) = rep.collectives
    assert c.kind == ALL_REDUCE and c.in_loop
    # static count: once, not times the trip count
    assert rep.total_ring_bytes == pytest.approx(ring_bytes(ALL_REDUCE, 4000, 8))


def test_collective_in_scan_is_flagged(mesh):
    def f(x):
        def body(c, _):
            return lax.all_gather(c, "data", tiled=True)[: c.shape[0]] + 1, None
        return lax.scan(body, x, None, length=4)[0]

    rep = collective_bytes(smap(f, mesh), jnp.ones(N * 100, jnp.float32))
    (c,) = rep.collectives
    assert c.kind == ALL_GATHER and c.in_loop and c.operand_bytes == 400


def test_collective_in_cond_is_found(mesh):
    def f(x):
        return lax.cond(x[0] > 0, lambda c: lax.psum(c, "data"), lambda c: c, x)

    rep = collective_bytes(smap(f, mesh), jnp.ones(N * 100, jnp.float32))
    (c,) = rep.collectives
    assert c.kind == ALL_REDUCE and c.in_conditional and not c.in_loop


def test_no_collective():
    rep = collective_bytes(lambda x: x * 2, jnp.ones(100))
    assert rep.collectives == ()
    assert rep.total_ring_bytes == 0.0 and rep.total_operand_bytes == 0
    assert rep.by_kind() == {}
    assert "TOTAL" in rep.table()


def test_u8_payload_stays_u8(mesh):
    # A bitcast uint8 payload must travel as u8 words, not widened to floats.
    def f(x):
        words = lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint8)  # [n, 2]
        g = lax.all_gather(words, "data", tiled=True)
        return lax.bitcast_convert_type(g, jnp.bfloat16).astype(jnp.float32)

    x = jnp.ones(N * 64, jnp.float32)
    assert hlo_collective_dtypes(smap(f, mesh), x) == frozenset({"u8"})
    rep = collective_bytes(smap(f, mesh), x)
    assert rep.total_operand_bytes == 64 * 2


def test_pmap_psum():
    f = jax.pmap(lambda x: lax.psum(x, "i"), axis_name="i")
    rep = collective_bytes(f, jnp.ones((N, 10), jnp.float32))
    (c,) = rep.collectives
    assert (c.kind, c.operand_bytes, c.group_size) == (ALL_REDUCE, 40, 8)


def test_lowered_and_compiled_objects_accepted(mesh):
    f = smap(lambda x: lax.psum(x, "data"), mesh)
    lowered = f.lower(jnp.ones(N * 10, jnp.float32))
    assert collective_bytes(lowered).total_operand_bytes == 40
    assert collective_bytes(lowered.compile()).total_operand_bytes == 40


def test_lowering_failure_names_fn():
    def my_broken_fn(x):
        return lax.psum(x, "no_such_axis")

    with pytest.raises(acc.AccountingError, match="my_broken_fn"):
        collective_bytes(my_broken_fn, jnp.ones(4))


# ---------------------------------------------------------- HLO text formats (parser)

_HEADER = "HloModule m, is_scheduled=true, entry_computation_layout={()->()}, num_partitions=8\n"


def _parse(body: str, header: str = _HEADER):
    return parse_hlo_collectives(header + body)


def test_async_start_forms_counted_once():
    hlo = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[1000], q: u8[100], r: f32[64]) -> f32[1000] {
  %p = f32[1000]{0} parameter(0)
  %q = u8[100]{0} parameter(1)
  %r = f32[64]{0} parameter(2)
  %ars = f32[1000]{0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ard = f32[1000]{0} all-reduce-done(%ars)
  %ags = (u8[100]{0}, u8[800]{0}) all-gather-start(%q), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = u8[800]{0} all-gather-done(%ags)
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%r), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[64]{0} collective-permute-done(%cps)
  ROOT %out = f32[1000]{0} copy(%ard)
}
"""
    rep = _parse(hlo)
    kinds = [(c.kind, c.operand_bytes, c.group_size, c.dtypes) for c in rep.collectives]
    assert kinds == [
        (ALL_REDUCE, 4000, 8, ("f32",)),
        (ALL_GATHER, 100, 8, ("u8",)),
        (COLLECTIVE_PERMUTE, 256, 4, ("f32",)),
    ]
    assert rep.total_ring_bytes == pytest.approx(7000 + 700 + 256)


def test_async_wrapped_computation_and_sugar_forms():
    hlo = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%async_computation (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  ROOT %a2a = f32[8,16]{1,0} all-to-all(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}

ENTRY %main (p: f32[8,16], q: f32[1024]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %q = f32[1024]{0} parameter(1)
  %as = ((f32[8,16]{1,0}), f32[8,16]{1,0}, s32[]) async-start(%p), calls=%async_computation
  %ad = f32[8,16]{1,0} async-done(%as), calls=%async_computation
  %rss = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-start(%q), channel_id=2, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, dimensions={0}, to_apply=%add
  %rsd = f32[256]{0} reduce-scatter-done(%rss)
  ROOT %o = f32[8,16]{1,0} copy(%ad)
}
"""
    rep = _parse(hlo)
    got = [(c.kind, c.operand_bytes, c.group_size) for c in rep.collectives]
    assert sorted(got) == sorted([(ALL_TO_ALL, 512, 4), (REDUCE_SCATTER, 4096, 4)])
    assert rep.total_ring_bytes == pytest.approx(3 / 4 * 512 + 3 / 4 * 4096)


def test_group_modes_and_empty_groups():
    body = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[10]) -> f32[10] {
  %p = f32[10]{0} parameter(0)
  %global = f32[10]{0} all-reduce(%p), channel_id=1, replica_groups={}, use_global_device_ids=true, to_apply=%add
  %xrep = f32[10]{0} all-reduce(%p), replica_groups={}, to_apply=%add
  %xrp = f32[10]{0} all-reduce(%p), channel_id=2, replica_groups={{0}}, to_apply=%add
  ROOT %iota = f32[10]{0} all-reduce(%p), channel_id=3, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
}
"""
    header = "HloModule m, replica_count=2, num_partitions=4\n"
    rep = _parse(body, header)
    sizes = {c.hlo_name: c.group_size for c in rep.collectives}
    assert sizes == {"global": 8, "xrep": 2, "xrp": 4, "iota": 2}
    assert rep.num_devices == 8


def test_while_body_nested_call_and_tuple_comments():
    hlo = """
%add (a: s32[], b: s32[]) -> s32[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %s = s32[] add(%a, %b)
}

%inner (x: s32[16]) -> (s32[8], s32[8]) {
  %x = s32[16]{0} parameter(0)
  %x0 = s32[8]{0} slice(%x), slice={[0:8]}
  %x1 = s32[8]{0} slice(%x), slice={[8:16]}
  ROOT %ar = (s32[8]{0}, /*index=1*/s32[8]{0}) all-reduce(%x0, %x1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
}

%body (t: (s32[], s32[16])) -> (s32[], s32[16]) {
  %t = (s32[], s32[16]{0}) parameter(0)
  %v = s32[16]{0} get-tuple-element(%t), index=1
  %c = (s32[8]{0}, s32[8]{0}) call(%v), to_apply=%inner
  ROOT %r = (s32[], s32[16]{0}) tuple(%i, %v)
}

%cond (t: (s32[], s32[16])) -> pred[] {
  %t = (s32[], s32[16]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (p: s32[16]) -> s32[16] {
  %p = s32[16]{0} parameter(0)
  %w = (s32[], s32[16]{0}) while(%init), condition=%cond, body=%body, metadata={op_name="calls=%bogus"}
  ROOT %o = s32[16]{0} get-tuple-element(%w), index=1
}
"""
    rep = _parse(hlo)
    (c,) = rep.collectives
    assert c.in_loop and c.computation == "inner"
    assert c.dtypes == ("s32", "s32") and c.operand_bytes == 64


def test_sub_byte_and_misc_dtypes():
    assert acc.dtype_bits("pred") == 8
    assert acc.dtype_bits("s4") == 4 and acc.dtype_bits("u4") == 4
    assert acc.dtype_bits("bf16") == 16 and acc.dtype_bits("f16") == 16
    assert acc.dtype_bits("f8e4m3fn") == 8 and acc.dtype_bits("f8e5m2") == 8
    assert acc.dtype_bits("c64") == 64 and acc.dtype_bits("c128") == 128
    assert acc.dtype_bits("u64") == 64
    hlo = """
ENTRY %main (p: s4[1000]) -> s4[8000] {
  %p = s4[1000]{0} parameter(0)
  ROOT %ag = s4[8000]{0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
}
"""
    (c,) = _parse(hlo).collectives
    assert c.operand_bytes == 500 and c.ring_bytes == pytest.approx(3500)


def test_report_is_frozen(mesh):
    rep = collective_bytes(smap(lambda x: lax.psum(x, "data"), mesh), jnp.ones(N, jnp.float32))
    with pytest.raises(Exception):
        rep.collectives = ()  # type: ignore[misc]
    with pytest.raises(Exception):
        rep.collectives[0].kind = "x"  # type: ignore[misc]
    assert np.isfinite(rep.total_ring_bytes)


def test_parser_tolerates_names_without_percent():
    hlo = """
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  p = f32[1000] parameter(0)
  ar = f32[1000] all-reduce(p), channel_id=1,
    replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=add
  ROOT o = f32[1000] copy(ar)
}
"""
    (c,) = _parse(hlo).collectives
    assert (c.kind, c.hlo_name, c.operand_bytes, c.group_size) == (ALL_REDUCE, "ar", 4000, 4)
