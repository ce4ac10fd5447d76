"""Host tier: bit-exact restores with no pass, group admission and LRU, refcounts, failure safety."""

from __future__ import annotations

import pytest
import torch

from adalncache import AdalnCache, plan_key
from adalncache.testing import inject_faults
from adalncache.tiers.host import HostTier
from tiers_support import plan, simple_embed, small_spec, tensor_source


def _rows_equal(a, b) -> bool:
    return torch.equal(a.block, b.block) and torch.equal(a.final, b.final)


def _cache(rows_in_tier: int, *, max_plans: int = 2):
    spec = small_spec()
    source = tensor_source(spec)
    host_bytes = rows_in_tier * (spec.row_bytes + 64)  # room for exactly `rows_in_tier` arena units
    cache = AdalnCache(spec, source, max_plans=max_plans, max_plan_width=4, host_cache_bytes=host_bytes)
    return spec, cache, simple_embed(spec)


def test_evicted_schedule_comes_back_bit_exact_with_zero_passes() -> None:
    _spec, cache, embed = _cache(rows_in_tier=16)
    first = [plan(0.9, 0.8), plan(0.5)]
    second = [plan(0.3, 0.2, 0.1), plan(0.05)]
    cache.build(first, embed=embed)
    reference = {plan_key(p): cache.rows_of(plan_key(p)) for p in first}
    cache.build(second, embed=embed)  # evicts `first` from the 2-slot slab
    assert all(plan_key(p) not in cache.resident_plans for p in first)
    cache.check_invariants()
    report = cache.build(first, embed=embed)
    assert report.passes == 0 and report.host_hits == 2 and report.built == 0 and report.bytes_read == 0
    for key, rows in reference.items():
        assert _rows_equal(cache.rows_of(key), rows)
    # And the served tensors (block/final) are the ones the original build produced.
    slot = cache.lookup(first[0])
    assert torch.equal(cache.block_rows(0, slot, 2), reference[plan_key(first[0])].block[:, 0])
    cache.check_invariants()
    assert cache.stats.host_hits == 2 and cache.stats.passes == 2


def test_group_larger_than_tier_is_skipped_and_counted() -> None:
    _spec, cache, embed = _cache(rows_in_tier=3, max_plans=4)
    report = cache.build([plan(0.9, 0.8), plan(0.7, 0.6)], embed=embed)  # 4 rows > 3
    assert report.built == 2 and report.tier_write_failures == 0
    assert cache.stats.host_pressure_skips == 1
    assert len(cache.host_tier) == 0
    cache.check_invariants()
    cache.build([plan(0.5)], embed=embed)  # a group that fits is still admitted
    assert len(cache.host_tier) == 1 and cache.stats.host_pressure_skips == 1
    cache.check_invariants()


def test_shared_plan_survives_eviction_of_one_group() -> None:
    spec = small_spec()
    tier = HostTier(spec, 4 * unit_bytes(spec), pin=False)
    cache = AdalnCache(spec, tensor_source(spec), max_plans=5, max_plan_width=4)
    embed = simple_embed(spec)
    shared, a, b, c, d = plan(0.5), plan(0.9), plan(0.8), plan(0.7), plan(0.6)
    cache.build([shared, a, b, c, d], embed=embed)
    s, ka, kb, kc, kd = (plan_key(p) for p in (shared, a, b, c, d))
    assert tier.admit([s, ka], cache.rows_of)
    assert tier.admit([s, kb], cache.rows_of)
    assert tier.refcount(s) == 2 and tier.used_bytes == 3 * unit_bytes(spec)
    tier.check_invariants()
    # Two new rows need room: the least recently used group {s, a} goes; s survives, held by {s, b}.
    assert tier.admit([kc, kd], cache.rows_of)
    tier.check_invariants()
    assert s in tier and ka not in tier and kb in tier
    assert tier.refcount(s) == 1 and tier.evicted_plans == 1
    assert _rows_equal(tier.lookup([s])[s], cache.rows_of(s))
    # Evicting the last holder frees it.
    assert tier.admit([plan_key(plan(0.9, 0.8, 0.7))], lambda key: _wide_rows(cache, spec, key))
    tier.check_invariants()
    assert s not in tier


def unit_bytes(spec) -> int:
    """Bytes of one arena unit (one timestep row, rounded to 64)."""
    return -(-spec.row_bytes // 64) * 64


def _wide_rows(cache: AdalnCache, spec, key):
    """Rows of a 3-timestep plan built on the spot (a fresh cache, so this one is left alone)."""
    other = AdalnCache(spec, cache.source, max_plans=1, max_plan_width=4)
    from adalncache.plans import key_to_plan

    other.build([key_to_plan(key)], embed=simple_embed(spec))
    return other.rows_of(key)


def test_shared_plan_survives_through_the_cache() -> None:
    """Same property end to end: two requests share a plan; the tier evicts the older request."""
    _spec, cache, embed = _cache(rows_in_tier=3, max_plans=2)
    shared = plan(0.5)
    cache.build([shared, plan(0.9)], embed=embed)
    cache.build([shared, plan(0.8)], embed=embed)
    assert cache.host_tier.refcount(plan_key(shared)) == 2
    cache.build([plan(0.7), plan(0.8)], embed=embed)  # needs a row: evicts group {shared, 0.9}
    tier = cache.host_tier
    tier.check_invariants()
    assert plan_key(shared) in tier and plan_key(plan(0.9)) not in tier
    assert cache.stats.host_evicted == 1
    report = cache.build([shared, plan(0.8)], embed=embed)
    assert report.passes == 0 and report.host_hits + report.device_hits == 2


@pytest.mark.parametrize("times", [1, 2])
def test_failure_in_host_write_after_publish_leaves_slab_correct_and_nothing_unaccounted(times: int) -> None:
    spec, cache, embed = _cache(rows_in_tier=8, max_plans=2)
    plans = [plan(0.9, 0.8), plan(0.5)]
    reference = AdalnCache(spec, cache.source, max_plans=2, max_plan_width=4)
    reference.build(plans, embed=embed)
    with inject_faults(cache, "host_write", times=times) as fault:
        report = cache.build(plans, embed=embed)
    assert fault.fired == 1
    assert report.tier_write_failures == 1 and cache.stats.tier_write_failures == 1
    for p in plans:
        key = plan_key(p)
        assert _rows_equal(cache.rows_of(key), reference.rows_of(key))
    tier = cache.host_tier
    assert len(tier) == 0 and tier.used_bytes == 0 and tier.free_bytes == tier.capacity_bytes
    cache.check_invariants()


def test_failure_inside_admit_copy_returns_every_unit() -> None:
    """A copy that fails half-way through a group (second plan) leaves the arena as it was."""
    spec = small_spec()
    cache = AdalnCache(spec, tensor_source(spec), max_plans=3, max_plan_width=4)
    embed = simple_embed(spec)
    plans = [plan(0.9, 0.8), plan(0.5), plan(0.4)]
    cache.build(plans, embed=embed)
    tier = HostTier(spec, 8 * unit_bytes(spec))
    assert tier.admit([plan_key(plans[2])], cache.rows_of)
    used = tier.used_bytes
    calls = []

    def failing(key):
        calls.append(key)
        if len(calls) == 2:
            raise OSError("injected copy failure")
        return cache.rows_of(key)

    with pytest.raises(OSError):
        tier.admit([plan_key(p) for p in plans], failing)
    tier.check_invariants()
    assert tier.used_bytes == used and len(tier) == 1 and tier.refcount(plan_key(plans[2])) == 1
    assert tier.admit([plan_key(p) for p in plans], cache.rows_of)  # a retry works
    tier.check_invariants()
    assert tier.refcount(plan_key(plans[2])) == 2


def test_invalidate_and_identity_change_empty_the_tier() -> None:
    _spec, cache, embed = _cache(rows_in_tier=8)
    cache.build([plan(0.5)], embed=embed)
    assert len(cache.host_tier) == 1
    cache.invalidate()
    assert len(cache.host_tier) == 0 and cache.host_tier.used_bytes == 0
    cache.check_invariants()
    cache.build([plan(0.5)], embed=embed, variant="lora-a")  # a new variant: tables from the old one go
    cache.build([plan(0.6)], embed=embed, variant="lora-b")
    assert plan_key(plan(0.5)) not in cache.host_tier
    cache.check_invariants()


def test_one_arena_allocated_once() -> None:
    spec = small_spec()
    tier = HostTier(spec, 5 * unit_bytes(spec) + 10)
    ptr = tier.arena.data_ptr()
    assert tier.arena.numel() == 5 * unit_bytes(spec) and tier.capacity_bytes == 5 * unit_bytes(spec) + 10
    cache = AdalnCache(spec, tensor_source(spec), max_plans=4, max_plan_width=4)
    embed = simple_embed(spec)
    for i in range(6):
        p = plan(0.1 * i + 0.05, 0.02)
        cache.build([p], embed=embed)
        tier.admit([plan_key(p)], cache.rows_of)
        tier.check_invariants()
    assert tier.arena.data_ptr() == ptr and len(tier) == 2 and tier.evicted_plans == 4
    too_small = HostTier(spec, 10)
    assert not too_small.admit([plan_key(plan(0.5))], cache.rows_of)
    too_small.check_invariants()


# -- model-based: random admissions against a reference of what must be held -----------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from adalncache.slab import PlanRows  # noqa: E402

_SPEC = small_spec()


def _rows_for(key) -> PlanRows:
    """Distinct, deterministic rows per key (the tier must hand back exactly these)."""
    n = len(key)
    g = torch.Generator().manual_seed(hash(key) & 0x7FFFFFFF)
    block = torch.randn(n, _SPEC.num_layers, _SPEC.block_width, generator=g).to(_SPEC.dtype)
    final = torch.randn(n, _SPEC.final_width, generator=g).to(_SPEC.dtype)
    return PlanRows(torch.zeros(n), block, final)


_KEYS = [plan_key(torch.linspace(0.1 * i, 0.1 * i + 0.05, w)) for i in range(8) for w in (1, 2, 3)]


@settings(max_examples=60, deadline=None)
@given(
    units=st.integers(0, 9),
    ops=st.lists(
        st.tuples(st.sets(st.sampled_from(range(len(_KEYS))), min_size=1, max_size=4), st.booleans()),
        max_size=25,
    ),
)
def test_random_admissions_keep_invariants_and_contents(units: int, ops) -> None:
    tier = HostTier(_SPEC, units * unit_bytes(_SPEC))
    for indices, fail in ops:
        group = [_KEYS[i] for i in indices]
        before = {k: tier.refcount(k) for k in _KEYS}
        calls = 0

        def rows_of(key, fail=fail):
            nonlocal calls
            calls += 1
            if fail and calls == 2:
                raise OSError("injected")
            return _rows_for(key)

        try:
            admitted = tier.admit(group, rows_of)
        except OSError:
            admitted = None
        tier.check_invariants()
        need = sum(len(k) for k in set(group))
        if need > units:
            assert admitted is False
        if admitted:
            assert all(k in tier for k in group)
        if admitted is None:  # a failed admit never adds references
            assert all(tier.refcount(k) <= before[k] for k in _KEYS)
        for key, rows in tier.lookup(_KEYS).items():
            want = _rows_for(key)
            assert torch.equal(rows.block, want.block) and torch.equal(rows.final, want.final)
    assert tier.used_bytes <= tier.capacity_bytes
