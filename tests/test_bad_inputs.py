"""Bad inputs at every layer of the stack: the right error type, a message that says what to change,
and a cache that is exactly as it was.

Why: a user who passes a wrong value should learn which argument or flag to fix from one line,
and a long-lived serving cache must not lose (or half-change) its resident tables because one
request or one construction was wrong. Each case below runs against a live cache with resident
plans; the cache's observable state (resident plans and their order, slot map, free slots,
``plan_lengths``, ``plan_timesteps``, every slab row, stats) is compared before and after.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from adalncache import (
    AdalnCache,
    CheckpointError,
    CheckpointSource,
    ConfigError,
    ModulationSpec,
    PlanError,
    PlanNotCachedError,
    Store,
    plan_key,
)
from adalncache.cli import main
from core_helpers import (
    SPEC,
    assert_plan_exact,
    assert_same_state,
    embed_for,
    load_reference,
    make_weights,
    snapshot,
    write_checkpoint,
)

EMBED = embed_for(SPEC)
A = torch.tensor([0.5])
B = torch.tensor([0.25, 0.75])


@dataclass(frozen=True)
class Bad:
    """One bad input: ``act(env)`` must raise ``error`` whose message matches ``says``."""

    name: str
    act: Callable[[Env], Any]
    error: type[BaseException]
    says: str

    def __repr__(self) -> str:
        return self.name


@dataclass
class Env:
    """A checkpoint on disk and a live cache holding plans A and B."""

    root: Path
    ckpt: Path
    cache: AdalnCache


@pytest.fixture
def env(tmp_path: Path) -> Env:
    ckpt = write_checkpoint(tmp_path / "ckpt", make_weights(SPEC))
    cache = AdalnCache(SPEC, CheckpointSource(ckpt, SPEC), max_plans=3, max_plan_width=2, store=tmp_path / "store")
    cache.build([A, B], embed=EMBED)
    return Env(tmp_path, ckpt, cache)


def _check(env: Env, case: Bad) -> None:
    before = snapshot(env.cache)
    with pytest.raises(case.error, match=case.says):
        case.act(env)
    assert_same_state(before, env.cache)
    env.cache.check_invariants()
    weights = load_reference(env.ckpt)
    for plan in (A, B):  # still served, still exact
        assert_plan_exact(env.cache, weights, "native", EMBED, plan)


def _write(env: Env, name: str, weights: dict[str, torch.Tensor]) -> Path:
    return write_checkpoint(env.root / name, weights)


def _without(key: str) -> dict[str, torch.Tensor]:
    weights = make_weights(SPEC)
    del weights[key]
    return weights


def _replaced(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    weights = make_weights(SPEC)
    weights[key] = value
    return weights


# -- spec ----------------------------------------------------------------------------------------

SPEC_CASES = [
    Bad("zero layers", lambda e: ModulationSpec(0, 8, 32), ConfigError, r"num_layers must be a positive"),
    Bad("negative hidden", lambda e: ModulationSpec(3, -8, 32), ConfigError, r"hidden_size must be a positive"),
    Bad("float embed dim", lambda e: ModulationSpec(3, 8, 32.0), ConfigError, r"time_embed_dim"),  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
    Bad("bool modalities", lambda e: ModulationSpec(3, 8, 32, modalities=True), ConfigError, r"modalities"),
    Bad("float64 dtype", lambda e: ModulationSpec(3, 8, 32, dtype=torch.float64), ConfigError, r"dtype must be one"),
    Bad("int8 dtype", lambda e: ModulationSpec(3, 8, 32, dtype=torch.int8), ConfigError, r"dtype must be one"),
]


@pytest.mark.parametrize("case", SPEC_CASES, ids=repr)
def test_spec_rejects(env: Env, case: Bad) -> None:
    _check(env, case)


# -- source --------------------------------------------------------------------------------------


def _truncated(env: Env) -> CheckpointSource:
    path = _write(env, "trunc", make_weights(SPEC))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    return CheckpointSource(path, SPEC)


def _not_safetensors(env: Env) -> CheckpointSource:
    path = env.root / "junk.safetensors"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not safetensors" * 10)
    return CheckpointSource(path, SPEC)


def _overlapping_span(env: Env) -> CheckpointSource:
    """A projection whose header entry overlaps the tensor before it (safetensors refuses such a file)."""
    path = _write(env, "overlap", make_weights(SPEC))
    blob = path.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    begin, end = header["blocks.1.adaln_proj.linear.weight"]["data_offsets"]
    header["blocks.1.adaln_proj.linear.weight"]["data_offsets"] = [begin - 2, end - 2]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + length :])
    return CheckpointSource(path, SPEC)


def _outside_index(env: Env) -> CheckpointSource:
    directory = env.root / "sharded"
    write_checkpoint(directory, make_weights(SPEC), shards=2)
    index = next(directory.glob("*.index.json"))
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "../ckpt/model.safetensors"
    index.write_text(json.dumps(data))
    return CheckpointSource(directory, SPEC)


def _wrong_layout(env: Env) -> CheckpointSource:
    path = write_checkpoint(env.root / "diff", make_weights(SPEC, layout="diffusers"))
    return CheckpointSource(path, SPEC, layout="native")


def _stray_copy(env: Env) -> CheckpointSource:
    """A diffusers directory that also keeps an old copy of the weights (same tensor names, other values)."""
    directory = env.root / "transformer"
    write_checkpoint(directory, make_weights(SPEC, layout="diffusers"), name="diffusion_pytorch_model")
    write_checkpoint(directory, make_weights(SPEC, layout="diffusers", seed=9), name="diffusion_pytorch_model.old")
    return CheckpointSource(directory, SPEC)


def _index_of_numbers(env: Env) -> CheckpointSource:
    directory = env.root / "numbered"
    write_checkpoint(directory, make_weights(SPEC), shards=2)
    index = next(directory.glob("*.index.json"))
    data = json.loads(index.read_text())
    data["weight_map"] = dict.fromkeys(data["weight_map"], 1)
    index.write_text(json.dumps(data))
    return CheckpointSource(directory, SPEC)


def _no_projection(env: Env) -> CheckpointSource:
    path = env.root / "other.safetensors"
    save_file({"something.else": torch.zeros(2)}, str(path))
    return CheckpointSource(path, SPEC)


SOURCE_CASES = [
    Bad(
        "missing weight",
        lambda e: CheckpointSource(_write(e, "m", _without("blocks.1.adaln_proj.linear.weight")), SPEC),
        CheckpointError,
        r"blocks\.1\.adaln_proj\.linear\.weight: missing",
    ),
    Bad(
        "misshapen bias",
        lambda e: CheckpointSource(
            _write(e, "s", _replaced("final_layer.adaln_proj.linear.bias", torch.zeros(7, dtype=SPEC.dtype))), SPEC
        ),
        CheckpointError,
        r"final_layer\.adaln_proj\.linear\.bias: shape \[7\], expected \[16\]",
    ),
    Bad(
        "integer weight",
        lambda e: CheckpointSource(
            _write(e, "i", _replaced("blocks.0.adaln_proj.linear.weight", torch.zeros(144, 32, dtype=torch.int32))),
            SPEC,
        ),
        CheckpointError,
        r"blocks\.0\.adaln_proj\.linear\.weight: dtype int32, expected bfloat16",
    ),
    Bad(
        "fp32 weight for a bf16 spec",
        lambda e: CheckpointSource(
            _write(e, "f", _replaced("blocks.2.adaln_proj.linear.weight", torch.zeros(144, 32))), SPEC
        ),
        CheckpointError,
        r"dtype float32, expected bfloat16 \(ModulationSpec\.dtype\)",
    ),
    Bad("truncated file", _truncated, CheckpointError, r"truncated.*re-save"),
    Bad("not safetensors", _not_safetensors, CheckpointError, r"not a safetensors file.*pass a \.safetensors"),
    Bad(
        "overlapping span",
        _overlapping_span,
        CheckpointError,
        r"overlap/model\.safetensors is a malformed safetensors file: tensor 'blocks\.1\.adaln_proj\.linear\.weight'"
        r".*overlaps",
    ),
    Bad("index outside directory", _outside_index, CheckpointError, r"outside the checkpoint directory"),
    Bad(
        "stray copy beside the weights",
        _stray_copy,
        CheckpointError,
        r"(?s)(?=.*diffusion_pytorch_model\.old\.safetensors)(?=.*diffusion_pytorch_model\.safetensors\b)"
        r"(?=.*--checkpoint)",
    ),
    Bad("index naming numbers", _index_of_numbers, CheckpointError, r"weight_map.*file names"),
    Bad("wrong layout", _wrong_layout, CheckpointError, r"missing"),
    Bad("no projections", _no_projection, CheckpointError, r"set layout= \(CLI --layout\)"),
    Bad("unknown layout", lambda e: CheckpointSource(e.ckpt, SPEC, layout="sgl"), ConfigError, r"--layout"),
    Bad("missing path", lambda e: CheckpointSource(e.root / "nope", SPEC), CheckpointError, r"does not exist"),
    Bad("empty file list", lambda e: CheckpointSource([], SPEC), CheckpointError, r"at least one"),
]


@pytest.mark.parametrize("case", SOURCE_CASES, ids=repr)
def test_source_rejects(env: Env, case: Bad) -> None:
    _check(env, case)


# -- cache ---------------------------------------------------------------------------------------


def _new_cache(**kwargs: Any) -> Callable[[Env], AdalnCache]:
    def make(env: Env) -> AdalnCache:
        return AdalnCache(SPEC, CheckpointSource(env.ckpt, SPEC), **kwargs)

    return make


def _build(*plans: Any) -> Callable[[Env], Any]:
    return lambda env: env.cache.build(list(plans), embed=EMBED)


CACHE_CASES = [
    Bad("zero max_plans", _new_cache(max_plans=0), ConfigError, r"max_plans.*--max-plans"),
    Bad("negative max_plans", _new_cache(max_plans=-4), ConfigError, r"max_plans.*--max-plans"),
    Bad("zero plan width", _new_cache(max_plan_width=0), ConfigError, r"max_plan_width.*--plan-width"),
    Bad("negative host tier", _new_cache(host_cache_bytes=-1), ConfigError, r"host_cache_bytes.*--host-cache-gb"),
    Bad("unknown precision", _new_cache(precision="fp16"), ConfigError, r"--precision"),
    Bad("unknown shard", _new_cache(shard="rows"), ConfigError, r"--shard"),
    Bad("bad device", _new_cache(device="warp-drive"), ConfigError, r"--device"),
    Bad(
        "source of another spec",
        lambda e: AdalnCache(ModulationSpec(3, 8, 32, dtype=torch.float16), CheckpointSource(e.ckpt, SPEC)),
        ConfigError,
        r"same ModulationSpec",
    ),
    Bad("NaN plan", _build(A, torch.tensor([float("nan")])), PlanError, r"finite"),
    Bad("inf plan", _build(torch.tensor([0.1, float("inf")])), PlanError, r"finite"),
    Bad("empty plan", _build(torch.empty(0)), PlanError, r"at least one timestep"),
    Bad("2-D plan", _build(torch.tensor([[0.5]])), PlanError, r"1-D float32.*timestep\.to\(torch\.float32\)"),
    Bad("float16 plan", _build(torch.tensor([0.5], dtype=torch.float16)), PlanError, r"float32"),
    Bad("float64 plan", _build(torch.tensor([0.5], dtype=torch.float64)), PlanError, r"float32"),
    Bad("integer plan", _build(torch.tensor([1])), PlanError, r"float32"),
    Bad("too wide", _build(A, torch.tensor([0.1, 0.2, 0.3])), PlanError, r"max_plan_width \(CLI --plan-width\)"),
    Bad(
        "too many",
        _build(A, B, torch.tensor([0.1]), torch.tensor([0.2])),
        PlanError,
        r"max_plans \(CLI --max-plans\) to at least 4",
    ),
    Bad("a single tensor", lambda e: e.cache.build(torch.tensor([0.3]), embed=EMBED), PlanError, r"wrap it in a list"),
    Bad("meta plan", _build(torch.tensor([0.5], device="meta")), PlanError, r"meta tensor"),
    Bad("no plans at all", lambda e: e.cache.build(None, embed=EMBED), PlanError, r"sequence of plans"),  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
    Bad("embed not callable", lambda e: e.cache.build([torch.tensor([0.3])], embed=None), PlanError, r"embed="),
    Bad("absent plan lookup", lambda e: e.cache.lookup(torch.tensor([0.3])), PlanNotCachedError, r"does not cover"),
    Bad("a slab too large to allocate", _new_cache(max_plans=10**12), ConfigError, r"bytes.*max_plans.*--max-plans"),
    Bad(
        "a host tier too large to allocate",
        _new_cache(host_cache_bytes=10**15),
        ConfigError,
        r"bytes.*host_cache_bytes.*--host-cache-gb",
    ),
    Bad("a number as store", _new_cache(store=5), ConfigError, r"store=.*--store"),
    Bad("the meta device", _new_cache(device="meta"), ConfigError, r"meta.*--device"),
    Bad("slot past the slab", lambda e: e.cache.block_rows(0, 999, 1), PlanError, r"slot.*0\.\.2"),
    Bad("negative slot", lambda e: e.cache.block_rows(0, -1, 1), PlanError, r"slot.*0\.\.2"),
    Bad("a free slot", lambda e: e.cache.final_rows(2, 1), PlanNotCachedError, r"slot 2 holds no plan"),
    Bad("final as a block layer", lambda e: e.cache.block_rows("final", 0, 1), PlanError, r"final_rows"),  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
    Bad("a bool as a layer", lambda e: e.cache.layer_rows(True, 0, 1), PlanError, r"layer True is not served"),
    Bad("fractional timesteps", lambda e: e.cache.block_rows(0, 0, 1.5), PlanError, r"num_timesteps"),  # type: ignore[arg-type]  # wrong on purpose: the refusal is what is tested
    Bad(
        "one key for two plans",
        lambda e: e.cache.resolve_slots([A, B], keys=[plan_key(A)]),
        PlanError,
        r"one key per plan",
    ),
    Bad(
        "a key that is not a key",
        lambda e: e.cache.build([torch.tensor([0.3])], embed=EMBED, keys=[None]),  # type: ignore[list-item]  # wrong on purpose: the refusal is what is tested
        PlanError,
        r"keys=",
    ),
    Bad(
        "absent plan resolve",
        lambda e: e.cache.resolve_slots([A, torch.tensor([0.3])]),
        PlanNotCachedError,
        r"does not cover.*build\(\)",
    ),
]


@pytest.mark.parametrize("case", CACHE_CASES, ids=repr)
def test_cache_rejects(env: Env, case: Bad) -> None:
    _check(env, case)


# -- tiers ---------------------------------------------------------------------------------------


def _store_on_file(env: Env) -> Store:
    path = env.root / "a-file"
    path.write_text("not a directory")
    return Store(path)


def _store_on_foreign_dir(env: Env) -> Store:
    path = env.root / "photos"
    path.mkdir()
    (path / "holiday.jpg").write_bytes(b"\xff\xd8")
    return Store(path)


TIER_CASES = [
    Bad("negative store size", lambda e: Store(e.root / "s1", max_bytes=-1), ConfigError, r"max_bytes.*--max-gb"),
    Bad("store on a file", _store_on_file, ConfigError, r"store="),
    Bad("store in a foreign directory", _store_on_foreign_dir, ConfigError, r"not .*store"),
    Bad("negative host bytes", _new_cache(host_cache_bytes=-(1 << 20)), ConfigError, r"--host-cache-gb"),
    Bad("bool host bytes", _new_cache(host_cache_bytes=True), ConfigError, r"host_cache_bytes"),
]


@pytest.mark.parametrize("case", TIER_CASES, ids=repr)
def test_tiers_reject(env: Env, case: Bad) -> None:
    _check(env, case)


@pytest.mark.parametrize("damage", ["other-spec", "corrupt"])
def test_store_entry_that_does_not_fit_is_a_miss_never_a_wrong_answer(env: Env, damage: str) -> None:
    """A store entry built for another spec, or a corrupted one, is never served: rebuilt exactly."""
    store_dir = env.root / "store"
    if damage == "other-spec":
        other = ModulationSpec(3, 8, 32, dtype=torch.float32)
        ck = write_checkpoint(env.root / "f32", make_weights(other))
        AdalnCache(other, CheckpointSource(ck, other), max_plans=2, store=store_dir).build([A], embed=embed_for(other))
    else:
        for entry in store_dir.rglob("*"):
            if entry.is_file() and entry.stat().st_size > 1000:  # a table entry, not a marker
                entry.write_bytes(entry.read_bytes()[:-7] + b"garbage")
    fresh = AdalnCache(SPEC, CheckpointSource(env.ckpt, SPEC), max_plans=3, max_plan_width=2, store=store_dir)
    report = fresh.build([A, B], embed=EMBED)
    if damage == "other-spec":  # the bf16 entries are this spec's; the fp32 one is not looked at
        assert report.store_hits == 2 and report.built == 0
    else:
        assert report.store_hits == 0 and report.built == 2 and fresh.stats.store_corrupt >= 1
    fresh.check_invariants()
    weights = load_reference(env.ckpt)
    for plan in (A, B):
        assert_plan_exact(fresh, weights, "native", EMBED, plan)


# -- command line --------------------------------------------------------------------------------

CLI_CASES = [
    (["build", "{ckpt}", "--store", "{root}/s", "--task", "t2v", "--steps", "4"], r"--task.*invalid choice"),
    (["build", "{ckpt}", "--store", "{root}/s", "--task", "t2va", "--steps", "-3"], r"--steps must be >= 1"),
    (["build", "{ckpt}", "--store", "{root}/s", "--task", "t2va", "--steps", "0"], r"--steps must be >= 1"),
    (["build", "{ckpt}", "--store", "{root}/s", "--task", "t2va", "--steps", "four"], r"--steps takes an integer"),
    (["build", "{ckpt}", "--store", "{root}/s", "--task", "t2va", "--steps", "4", "--max-plans", "0"], r"--max-plans"),
    (
        ["build", "{ckpt}", "--store", "{root}/s", "--task", "t2va", "--steps", "4", "--plan-width", "0"],
        r"--plan-width",
    ),
    (
        ["build", "{tiny}", "--store", "{root}/s", "--task", "ref2va", "--steps", "4", "--plan-width", "2"],
        r"--plan-width",
    ),
    (["build", "{ckpt}", "--store", "{root}/s", "--task", "t2va", "--steps", "4"], r"pass the whole transformer"),
    (["build", "{ckpt}", "--store", "{root}/s", "--task", "t2va", "--steps", "4", "--precision", "x"], r"--precision"),
    (["build", "{root}/missing", "--store", "{root}/s", "--task", "t2va", "--steps", "4"], r"does not exist"),
    (["inspect", "{root}/missing"], r"does not exist"),
    (
        ["build", "{tiny}", "--store", "{root}/s", "--task", "t2va", "--steps", "4", "--host-cache-gb", "100000"],
        r"bytes.*--host-cache-gb",
    ),
    (["demo", "--seed", "99999999999999999999"], r"--seed"),
    (["store", "prune", "--store", "{root}/s"], r"--max-gb"),
    (["frobnicate"], r"invalid choice"),
]


@pytest.mark.parametrize("argv,says", CLI_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_cli_rejects(
    env: Env, tiny_saved_root: Path, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(env.cache)
    args = [a.format(ckpt=env.ckpt, root=env.root, tiny=tiny_saved_root / "bf16") for a in argv]
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors exit; library errors return 2
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    assert err.startswith("adalncache"), err
    assert len(err.splitlines()) == 1 or err.splitlines()[0].startswith("usage:"), err
    assert re.search(says, err.splitlines()[-1]), err
    assert_same_state(before, env.cache)
    assert not (env.root / "s").exists() or not any((env.root / "s").rglob("*.tbl")), "a rejected build wrote"


# -- diffusers integration -----------------------------------------------------------------------


def _tiny_cases() -> list[tuple[str, Callable[[Any, Path], Any], type[BaseException], str]]:
    from adalncache.diffusers import enable_adaln_cache

    def mismatched_checkpoint(model: Any, root: Path) -> Any:
        from adalncache.tools.tiny import tiny_transformer

        other = tiny_transformer("tiny", seed=5)
        other.save_pretrained(root / "other")
        return enable_adaln_cache(model, root / "other")

    return [
        ("on_miss", lambda m, r: enable_adaln_cache(m, on_miss="ignore"), ConfigError, r"on_miss"),
        ("zero max_plans", lambda m, r: enable_adaln_cache(m, max_plans=0), ConfigError, r"--max-plans"),
        ("not a model", lambda m, r: enable_adaln_cache(torch.nn.Linear(2, 2)), ConfigError, r"MiniMax"),
        (
            "mismatched checkpoint",
            mismatched_checkpoint,
            ConfigError,
            r"checkpoint= \(CLI --checkpoint\) does not match",
        ),
    ]


def _hook_names(model: Any) -> list[tuple[str, str]]:
    """Every diffusers hook registered on the model's modules (a failed enable must leave none)."""
    out = []
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        out += [(name, hook) for hook in sorted(getattr(registry, "hooks", None) or {})]
    return out


@pytest.mark.parametrize("index", range(4), ids=["on_miss", "zero max_plans", "not a model", "mismatched checkpoint"])
def test_diffusers_rejects(load_tiny: Callable[[str], Any], tmp_path: Path, index: int) -> None:
    pytest.importorskip("diffusers")
    name, act, error, says = _tiny_cases()[index]
    model = load_tiny("bf16-disk")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks_before = _hook_names(model)
    with pytest.raises(error, match=says):
        act(model, tmp_path)
    after = model.state_dict()
    assert before.keys() == after.keys(), f"{name}: the model's parameters changed"
    assert all(torch.equal(before[k], after[k]) for k in before), f"{name}: a weight changed"
    assert all(p.device.type != "meta" for p in model.parameters()), f"{name}: a weight was left freed"
    assert _hook_names(model) == hooks_before, f"{name}: a hook was left behind"


def test_diffusers_fused_lora_while_enabled_is_refused(load_tiny: Callable[[str], Any], tmp_path: Path) -> None:
    """Fusing a LoRA into served modules while enabled: ConfigError naming disable(); the cache is unchanged."""
    pytest.importorskip("peft")
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    from adalncache.diffusers import enable_adaln_cache
    from adalncache.tools.tiny import make_request
    from test_diffusers_lora import _lora_file

    model = load_tiny("bf16-disk")
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=model)
    lora = _lora_file(model, tmp_path / "lora.safetensors", seed=4)
    handle = enable_adaln_cache(pipe)
    pipe.load_lora_weights(str(lora), adapter_name="turbo")
    handle.prepare(make_request(model, "t2va", 4, seed=0).plans)
    cache = handle.transformer.cache if hasattr(handle, "transformer") else handle.cache
    before = snapshot(cache)
    with pytest.raises(ConfigError, match=r"disable\(\)"):
        pipe.fuse_lora()
    assert_same_state(before, cache)
    handle.disable()


# -- prepared requests: handle.prepare / request / release -----------------------------------------

_T = torch.tensor([0.5])
_IDX = torch.tensor([1])

#: ``(name, act(handle), error, says)``: bad arguments of a layered Qwen-Image handle's request API.
PREPARE_CASES: list[tuple[str, Callable[[Any], Any], type[BaseException], str]] = [
    ("plans None", lambda h: h.prepare(None), PlanError, r"plans must be a list .*--timesteps"),
    ("one tensor, not a list", lambda h: h.prepare(torch.tensor([0.5, 0.25])), PlanError, r"plans must be a list"),
    ("one mapping, not a list", lambda h: h.prepare({"timestep": _T, "additional_t_cond": _IDX}), PlanError, r"wrap"),
    ("a string", lambda h: h.request("0.5").__enter__(), PlanError, r"plans must be a list"),
    ("mapping without its index", lambda h: h.prepare([{"timestep": _T}]), PlanError, r"additional_t_cond"),
    ("mapping of another name", lambda h: h.prepare([{"t": _T, "additional_t_cond": _IDX}]), PlanError, r"'timestep'"),
    (
        "float index",
        lambda h: h.prepare([{"timestep": _T, "additional_t_cond": torch.tensor([0.5])}]),
        PlanError,
        r"integer index .*--additional-t-cond",
    ),
    (
        "index past the embedding's rows",
        lambda h: h.prepare([{"timestep": _T, "additional_t_cond": torch.tensor([7])}]),
        PlanError,
        r"index in 0\.\.1 .*got 7.*--additional-t-cond",
    ),
    (
        "integer timestep",
        lambda h: h.prepare([{"timestep": _IDX, "additional_t_cond": _IDX}]),
        PlanError,
        r"floating-point",
    ),
    (
        "2-D timestep",
        lambda h: h.prepare([{"timestep": _T.reshape(1, 1), "additional_t_cond": _IDX}]),
        PlanError,
        r"1-D",
    ),
    (
        "empty timestep",
        lambda h: h.prepare([{"timestep": _T[:0], "additional_t_cond": _IDX[:0]}]),
        PlanError,
        r"at least one",
    ),
    (
        "NaN timestep",
        lambda h: h.prepare([{"timestep": torch.tensor([float("nan")]), "additional_t_cond": _IDX}]),
        PlanError,
        r"finite",
    ),
    (
        "meta timestep",
        lambda h: h.prepare([{"timestep": _T.to("meta"), "additional_t_cond": _IDX}]),
        PlanError,
        r"meta",
    ),
    (
        "too many plans",
        lambda h: h.prepare([{"timestep": torch.tensor([i / 10]), "additional_t_cond": _IDX} for i in range(9)]),
        PlanError,
        r"--max-plans",
    ),
    (
        "attention_kwargs a string",
        lambda h: h.prepare([{"timestep": _T, "additional_t_cond": _IDX}], attention_kwargs="scale"),
        ConfigError,
        r"attention_kwargs",
    ),
    (
        "LoRA scale a string",
        lambda h: h.prepare([{"timestep": _T, "additional_t_cond": _IDX}], attention_kwargs={"scale": "x"}),
        ConfigError,
        r'\["scale"\]',
    ),
    (
        "LoRA scale NaN",
        lambda h: h.prepare([{"timestep": _T, "additional_t_cond": _IDX}], attention_kwargs={"scale": float("nan")}),
        ConfigError,
        r"finite",
    ),
    ("release(check='no')", lambda h: h.release(check="no"), ConfigError, r"check=.*True or False"),
]


def _table_state(cache: AdalnCache) -> dict[str, object]:
    """What ``snapshot`` compares, for a family of named layers (the whole table, not MiniMax's parts)."""
    return {
        "order": cache.resident_plans,
        "free": sorted(cache.free_slots),
        "lengths": cache.plan_lengths.clone(),
        "timesteps": cache.plan_timesteps.clone(),
        "table": cache.table.clone(),
        "stats": cache.stats.as_dict(),
    }


@pytest.fixture(scope="module")
def layered_qwen() -> tuple[Any, Any, dict[str, Any]]:
    """A resident and a to-be-served tiny layered Qwen-Image (two-column plans), and a forward's arguments."""
    pytest.importorskip("diffusers")
    from adalncache.tools.tiny_qwen import tiny_qwen_inputs, tiny_qwen_transformer

    resident, served = tiny_qwen_transformer("layered"), tiny_qwen_transformer("layered")
    return resident, served, tiny_qwen_inputs(resident, 1)


@pytest.mark.parametrize("index", range(len(PREPARE_CASES)), ids=[case[0] for case in PREPARE_CASES])
def test_prepare_rejects(layered_qwen: tuple[Any, Any, dict[str, Any]], index: int) -> None:
    """Each bad request argument is refused by name and changes nothing: the prepared request, the
    resident tables and the stats stay; the prepared forward is still served exactly, on the device."""
    from adalncache.diffusers import enable_adaln_cache

    name, act, error, says = PREPARE_CASES[index]
    resident, model, inputs = layered_qwen
    with torch.no_grad():
        expected = resident(**inputs)[0]
    handle = enable_adaln_cache(model, max_plans=4)
    try:
        handle.prepare([{"timestep": inputs["timestep"], "additional_t_cond": inputs["additional_t_cond"]}])
        before = _table_state(handle.cache)
        with pytest.raises(error, match=says):
            act(handle)
        after = _table_state(handle.cache)
        assert before.keys() == after.keys()
        for key, value in before.items():
            same = torch.equal(value, after[key]) if isinstance(value, torch.Tensor) else value == after[key]
            assert same, f"{name}: {key} changed"
        handle.cache.check_invariants()
        with torch.no_grad():
            served = model(**inputs)[0]
        assert torch.equal(served, expected), f"{name}: not exact after the refusal"
        handle.check_request()  # no miss: the refusal served nothing from the poison slot
    finally:
        handle.release(check=False)
        handle.disable()


def test_prepare_rejects_a_meta_input_of_a_three_column_family() -> None:
    """HunyuanImage (timestep, timestep_r, guidance): a meta guidance is a PlanError, not a
    RuntimeError about devices from stacking the columns; the prepared request stays and is exact."""
    pytest.importorskip("diffusers")
    import adaln_zero_helpers as tiny_adaln_zero
    from adalncache.diffusers import enable_adaln_cache
    from adalncache.families import adaln_zero

    model = tiny_adaln_zero.build("HunyuanImageTransformer2DModel", use_meanflow=True, guidance_embeds=True)
    plan = {
        "timestep": torch.tensor([713.1]),
        adaln_zero.TIMESTEP_R: torch.tensor([501.1]),
        adaln_zero.GUIDANCE: torch.tensor([3500.0]),
    }
    handle = enable_adaln_cache(model, max_plans=4)
    try:
        handle.prepare([plan])
        before = _table_state(handle.cache)
        with pytest.raises(PlanError, match="meta tensor"):
            handle.prepare([{**plan, adaln_zero.GUIDANCE: plan[adaln_zero.GUIDANCE].to("meta")}])
        after = _table_state(handle.cache)
        for key, value in before.items():
            same = torch.equal(value, after[key]) if isinstance(value, torch.Tensor) else value == after[key]
            assert same, f"{key} changed"
        handle.cache.check_invariants()
    finally:
        handle.disable()


# -- schedule flags of every family ------------------------------------------------------------------

#: ``(checkpoint, flags, says)``: every error of a family's schedule flags (argparse's and the family's), each
#: of which must exit 2 with one line naming the flag, for ``build`` and ``export`` alike, and leave nothing on
#: disk (no store skeleton, no table file, no temporary file). ``{name}`` is a scheduler config file.
SCHEDULE_CLI_CASES: list[tuple[str, list[str], str]] = [
    ("minimax", [], r"needs --task and --steps"),
    ("minimax", ["--task", "t2va"], r"needs --task and --steps"),
    ("minimax", ["--task", "t2vx", "--steps", "4"], r"--task.*invalid choice"),
    ("minimax", ["--task", "t2va", "--steps", "0"], r"--steps must be >= 1"),
    ("minimax", ["--task", "t2va", "--steps", "1"], r"steps must be an integer >= 2.*--steps"),
    ("minimax", ["--task", "t2va", "--steps", "4", "--video-shift", "0"], r"video_shift must be a positive.*--video"),
    ("minimax", ["--task", "t2va", "--steps", "4", "--audio-shift", "nan"], r"audio_shift must be a positive.*--audio"),
    ("minimax", ["--task", "t2va", "--steps", "4", "--guidance", "3"], r"--guidance names AdaLayerNormZero.*drop"),
    ("minimax", ["--task", "t2va", "--steps", "4", "--timesteps", "0.5"], r"--timesteps names.*drop --timesteps"),
    (
        "layered",
        ["--timesteps", "0.5", "--additional-t-cond", "99999999999999999999"],
        r"--additional-t-cond must be <",
    ),
    ("layered", ["--timesteps", "0.5", "--additional-t-cond", "-1"], r"--additional-t-cond must be >= 0"),
    ("layered", ["--timesteps", "0.5", "--additional-t-cond", "7"], r"additional_t_cond must be an index in 0\.\.1"),
    ("layered", ["--steps", "4", "--additional-t-cond", "2"], r"additional_t_cond .* --additional-t-cond"),
    ("layered", ["--timesteps", "0.5"], r"pass --additional-t-cond"),
    ("layered", ["--timesteps", "nan", "--additional-t-cond", "1"], r"--timesteps must be finite"),
    ("layered", ["--timesteps", "1e40", "--additional-t-cond", "1"], r"--timesteps must be finite"),
    ("layered", ["--timesteps", "0.5,x", "--additional-t-cond", "1"], r"--timesteps must be comma-separated numbers"),
    ("layered", ["--timesteps", ",", "--additional-t-cond", "1"], r"--timesteps is empty"),
    ("plain", ["--timesteps", "0.5", "--additional-t-cond", "1"], r"drop --additional-t-cond"),
    (
        "plain",
        ["--steps", "1"],
        r"--steps 1 at --height 1024 --width 1024 has non-finite.*use --steps 2 \(the smallest",
    ),
    ("plain", [], r"name a Qwen-Image schedule: --steps N"),
    ("plain", ["--steps", "4", "--batch", "0"], r"--batch must be >= 1"),
    ("plain", ["--steps", "4", "--height", "64", "--height", "32", "--width", "64"], r"--width is given 1 time"),
    ("plain", ["--steps", "4", "--scheduler-config", "{missing}"], r"cannot be read.*--scheduler-config"),
    ("plain", ["--steps", "4", "--scheduler-config", "{notobject}"], r"--scheduler-config .* is not a JSON object"),
    ("plain", ["--steps", "4", "--scheduler-config", "{wrongtype}"], r"cannot be computed from --scheduler-config"),
    ("plain", ["--steps", "4", "--height", "1000000000", "--width", "1000000000"], r"--height 1000000000 --width"),
    ("plain", ["--task", "t2va", "--steps", "4"], r"--task names MiniMax-H3 schedules.*drop --task"),
    ("plain", ["--timesteps", "0.5", "--steps", "4"], r"--timesteps and --steps both name the schedule"),
    (
        "bria",
        ["--steps", "4", "--height", "8", "--width", "8", "--scheduler-config", "{wrongtype}"],
        r"cannot be computed from --scheduler-config",
    ),
    ("bria", ["--steps", "4", "--scheduler-config", "{ddim}"], r"names a DDIMScheduler.*--timesteps"),
    ("bria", ["--timesteps", "0.5", "--guidance", "3"], r"drop --guidance"),
    ("bria", ["--timesteps", "0.5", "--additional-t-cond", "1"], r"--additional-t-cond names Qwen-Image.*drop"),
    ("bria", ["--timesteps", "0.5", "--steps", "4", "--guidance", "3"], r"--timesteps and --steps both name"),
    ("hunyuan", ["--timesteps", "500", "--timestep-r", "250"], r"makes guidance an input of temb: pass --guidance"),
    ("hunyuan", ["--timesteps", "500", "--guidance", "3500"], r"makes timestep_r an input.*pass --timestep-r"),
    ("hunyuan", ["--timesteps", "500", "--timestep-r", "250", "--guidance", "nan"], r"--guidance must be finite"),
    ("hunyuan", ["--timesteps", "500", "--timestep-r", "x", "--guidance", "3"], r"--timestep-r must be comma-sep"),
    ("hunyuan", ["--timesteps", "5,2", "--timestep-r", "2", "--guidance", "3"], r"--timestep-r has 1 value\(s\) for 2"),
    ("hunyuan", ["--steps", "4", "--timestep-r", "250", "--guidance", "3"], r"--timestep-r pairs with --timesteps"),
    (
        "hunyuan",
        ["--steps", "4", "--guidance", "3", "--scheduler-config", "{dynamic}"],
        r"use_dynamic_shifting.*--time",
    ),
    ("motif", ["--steps", "4", "--scheduler-config", "{flowmatch}"], r"pass the forward's timesteps \(--timesteps\)"),
]

#: The scheduler configs the cases name (``{name}``), beside the checkpoints.
SCHEDULER_CONFIGS = {
    "wrongtype": {"shift": "x", "use_dynamic_shifting": True, "base_shift": "a", "max_shift": "b"},
    "notobject": [1, 2],
    "dynamic": {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True},
    "flowmatch": {"_class_name": "FlowMatchEulerDiscreteScheduler"},
    "ddim": {"_class_name": "DDIMScheduler"},
}


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny layered and plain Qwen-Image, Bria, HunyuanImage-2.1 (mean-flow and guidance) and Motif-Video
    checkpoints (the AdaLayerNormZero family), and the scheduler configs of :data:`SCHEDULER_CONFIGS`."""
    pytest.importorskip("diffusers")
    import adaln_zero_helpers as tiny_adaln_zero
    from adalncache.tools.tiny_qwen import tiny_qwen_transformer

    root = tmp_path_factory.mktemp("families")
    tiny_qwen_transformer("layered").save_pretrained(root / "layered")
    tiny_qwen_transformer("plain").save_pretrained(root / "plain")
    tiny_adaln_zero.build("BriaTransformer2DModel").save_pretrained(root / "bria")
    hunyuan = tiny_adaln_zero.build("HunyuanImageTransformer2DModel", use_meanflow=True, guidance_embeds=True)
    hunyuan.save_pretrained(root / "hunyuan")
    tiny_adaln_zero.build("MotifVideoTransformer3DModel").save_pretrained(root / "motif")
    for name, config in SCHEDULER_CONFIGS.items():
        (root / f"{name}.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(
    "index",
    range(len(SCHEDULE_CLI_CASES)),
    ids=lambda i: " ".join(SCHEDULE_CLI_CASES[i][:1]) + " " + " ".join(SCHEDULE_CLI_CASES[i][1]),
)
@pytest.mark.parametrize("command", ["build", "export"])
def test_cli_schedule_flags_of_every_family_are_refused(
    family_checkpoints: Path,
    tiny_saved_root: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    index: int,
    tmp_path: Path,
) -> None:
    """Every schedule-flag error of every family is one line naming the flag, exit 2, and leaves nothing on disk."""
    checkpoint, flags, says = SCHEDULE_CLI_CASES[index]
    configs = {name: family_checkpoints / f"{name}.json" for name in [*SCHEDULER_CONFIGS, "missing"]}
    flags = [flag.format(**configs) for flag in flags]
    directory = tiny_saved_root / "bf16" if checkpoint == "minimax" else family_checkpoints / checkpoint
    work = tmp_path / "work"
    work.mkdir()
    args = [command, str(directory), "--store", str(work / "s"), *flags, "-q"]
    if command == "export":
        args += ["-o", str(work / "t.safetensors")]
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors exit
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    assert len(err.splitlines()) == 1 or err.splitlines()[0].startswith("usage:"), err
    assert re.search(says, err.splitlines()[-1]), err
    assert list(work.iterdir()) == [], "a refused command left something on disk"


# -- files that are not regular files, and ambiguous directories ------------------------------------

_FIFO_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from core_helpers import SPEC
from adalncache import CheckpointError, CheckpointSource
from adalncache.cli import main
source = CheckpointSource({directory!r}, SPEC)
code = main(["inspect", {directory!r}])
try:
    CheckpointSource({fifo!r}, SPEC)
    refused = None
except CheckpointError as exc:
    refused = str(exc)
print(json.dumps({{"files": [str(f) for f in source.files], "inspect": code, "refused": refused}}))
"""


def test_a_fifo_named_like_a_checkpoint_file_never_blocks(tmp_path: Path) -> None:
    """A named pipe ``*.safetensors`` in a checkpoint directory: skipped (never opened, which would
    wait for a writer forever); named itself, refused. Run in a child so that a hang fails the test."""
    directory = tmp_path / "ckpt"
    model = write_checkpoint(directory, make_weights(SPEC))
    fifo = directory / "incoming.safetensors"
    os.mkfifo(fifo)
    code = _FIFO_CHILD.format(tests=str(Path(__file__).parent), directory=str(directory), fifo=str(fifo))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("opening a checkpoint directory that holds a FIFO blocked")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["files"] == [str(model)] and out["inspect"] == 0
    assert out["refused"] is not None and "not a regular file" in out["refused"]


def test_cli_refuses_an_ambiguous_directory_naming_both_files(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CheckpointError):
        _stray_copy(env)
    stray = env.root / "transformer"
    store = str(env.root / "store")
    for argv in (["inspect", str(stray)], ["verify", "--store", store, "--checkpoint", str(stray)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "diffusion_pytorch_model.old.safetensors" in err, err
        assert "--checkpoint" in err and "CHECKPOINT" in err, err


def test_prepare_refuses_an_unknown_key_of_an_adaln_zero_plan() -> None:
    """HunyuanImage given Qwen-Image's ``additional_t_cond``: PlanError naming the accepted keys (was ignored)."""
    pytest.importorskip("diffusers")
    import adaln_zero_helpers as tiny_adaln_zero
    from adalncache.diffusers import enable_adaln_cache

    model = tiny_adaln_zero.build("HunyuanImageTransformer2DModel")
    handle = enable_adaln_cache(model, max_plans=4)
    try:
        with pytest.raises(PlanError, match=r"takes the keys \['timestep'\].*additional_t_cond"):
            handle.prepare([{"timestep": torch.tensor([713.1]), "additional_t_cond": torch.tensor([1])}])
        assert handle.stats.passes == 0
    finally:
        handle.disable()
