"""Checkpoint headers are validated at construction, the way safetensors validates them.

Why: a corrupt header entry used to pass construction and fail the build later with an internal
torch message (``self.storage_offset() must be divisible by 2``). Every case below writes a good
checkpoint with safetensors' own ``save_file``, corrupts its header on disk, and checks that
construction raises ``CheckpointError`` naming the file and the tensor, and that safetensors
itself refuses the same file. The fuzz test mutates headers at random: every outcome is either a
construction followed by a build equal bit for bit to ``F.linear`` on safetensors' own loaded
tensors, or a ``CheckpointError``; never another exception.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from adalncache import AdalnCache, BuildError, CheckpointError, CheckpointSource
from adalncache.source.files import LazyTensor, write_safetensors
from adalncache.source.reads import ALIGNMENT, aligned_empty
from adalncache.spec import LAYOUTS
from core_helpers import SPEC, assert_plan_exact, embed_for, make_weights, write_checkpoint

EMBED = embed_for(SPEC)
PLAN = torch.tensor([0.5, 0.25])
#: The tensor the cases corrupt: a projection weight in the middle of the file.
TARGET = LAYOUTS["native"].weight(1)


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _join(path: Path, header: dict[str, Any] | bytes, data: bytes) -> Path:
    """Write ``header`` and ``data`` as a file; a dict header is padded to 8 bytes as safetensors pads it."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if not isinstance(header, bytes):
        raw += b" " * (-len(raw) % 8)  # so the data keep their alignment and only the mutation is wrong
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "good", make_weights(SPEC))


def _safetensors_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt"):
            return False
    except Exception:
        return True


Entry = dict[str, Any]


def _offsets(change: Callable[[int, int], list[Any]]) -> Callable[[Entry], None]:
    def mutate(entry: Entry) -> None:
        entry["data_offsets"] = change(*entry["data_offsets"])

    return mutate


def _set(field: str, value: Any) -> Callable[[Entry], None]:
    def mutate(entry: Entry) -> None:
        entry[field] = value

    return mutate


def _shape(change: Callable[[list[int]], Any]) -> Callable[[Entry], None]:
    def mutate(entry: Entry) -> None:
        entry["shape"] = change(entry["shape"])

    return mutate


ENTRY_CASES: dict[str, tuple[Callable[[Entry], None], str]] = {
    "float begin": (_offsets(lambda b, e: [float(b), e]), "not two non-negative integers"),
    "float end": (_offsets(lambda b, e: [b, float(e)]), "not two non-negative integers"),
    "bool end": (_offsets(lambda b, e: [b, True]), "not two non-negative integers"),
    "negative begin": (_offsets(lambda b, e: [-b, e]), "not two non-negative integers"),
    "three offsets": (_offsets(lambda b, e: [b, e, e]), "not two non-negative integers"),
    "end before begin": (_offsets(lambda b, e: [e, b]), "ends before it begins"),
    "overlaps the previous tensor": (_offsets(lambda b, e: [b - 2, e - 2]), "overlaps"),
    "gap before it": (_offsets(lambda b, e: [b + 2, e + 2]), "belong to no tensor"),
    "past the end of the file": (_offsets(lambda b, e: [b + 10**9, e + 10**9]), "truncated .*re-save"),
    "span longer than its shape": (_shape(lambda s: [s[0] - 1, s[1]]), r"spans \d+ bytes .* needs \d+ bytes"),
    "unknown dtype": (_set("dtype", "BF17"), "unknown dtype"),
    "dtype not a string": (_set("dtype", 16), "unknown dtype"),
    "negative dimension": (_shape(lambda s: [-s[0], s[1]]), "not a list of non-negative integers"),
    "float dimension": (_shape(lambda s: [float(s[0]), s[1]]), "not a list of non-negative integers"),
    "shape not a list": (_shape(lambda s: f"{s[0]}x{s[1]}"), "not a list of non-negative integers"),
    "no data_offsets": (lambda entry: entry.pop("data_offsets"), "has no 'data_offsets'"),
    "empty entry": (lambda entry: entry.clear(), "has no 'dtype'"),
}


@pytest.mark.parametrize("case", list(ENTRY_CASES), ids=str)
def test_corrupt_entry_is_refused_naming_file_and_tensor(good: Path, case: str) -> None:
    mutate, says = ENTRY_CASES[case]
    header, data = _split(good)
    mutate(header[TARGET])
    path = _join(good.with_name("bad.safetensors"), header, data)
    assert _safetensors_refuses(path)  # a real violation of the format, not a rule of ours
    with pytest.raises(CheckpointError, match=says) as err:
        CheckpointSource(path, SPEC)
    message = str(err.value)
    assert str(path) in message and repr(TARGET) in message
    assert "malformed" in message or "truncated" in message


def _last_tensor(header: dict[str, Any]) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def _raw_with_duplicate(header: dict[str, Any]) -> bytes:
    text = json.dumps(header)
    return (text[:-1] + f", {json.dumps(TARGET)}: {json.dumps(header[TARGET])}}}").encode()


FILE_CASES: dict[str, tuple[Callable[[dict[str, Any], bytes], tuple[dict[str, Any] | bytes, bytes]], str]] = {
    "bytes after the last tensor": (lambda h, d: (h, d + b"\0" * 8), "belong to no tensor"),
    "data cut short": (lambda h, d: (h, d[:-8]), "truncated .*re-save"),
    "metadata values not strings": (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d), "__metadata__"),
    "metadata not a map": (lambda h, d: ({**h, "__metadata__": "pt"}, d), "__metadata__"),
    "header not UTF-8": (lambda h, d: (json.dumps(h).encode()[:-1] + b', "\xff": 1}', d), "not valid JSON"),
    "header not an object": (lambda h, d: (b"[" + json.dumps(h).encode() + b"]", d), "not a JSON object"),
    "NaN in the header": (lambda h, d: (json.dumps({**h, "__metadata__": {"x": float("nan")}}).encode(), d), "NaN"),
    "a tensor named twice": (lambda h, d: (_raw_with_duplicate(h), d), "twice"),
}


@pytest.mark.parametrize("case", list(FILE_CASES), ids=str)
def test_corrupt_file_is_refused_naming_it(good: Path, case: str) -> None:
    mutate, says = FILE_CASES[case]
    header, data = _split(good)
    last = _last_tensor(header)
    new_header, new_data = mutate(header, data)
    path = _join(good.with_name("bad.safetensors"), new_header, new_data)
    # A name given twice is ambiguous JSON; safetensors keeps the last entry, this reader refuses.
    assert _safetensors_refuses(path) or case == "a tensor named twice"
    with pytest.raises(CheckpointError, match=says) as err:
        CheckpointSource(path, SPEC)
    message = str(err.value)
    assert str(path) in message
    if case in ("bytes after the last tensor", "data cut short"):
        assert repr(last) in message
    if case == "a tensor named twice":
        assert repr(TARGET) in message


def test_header_length_beyond_the_file_is_refused(good: Path) -> None:
    blob = bytearray(good.read_bytes())
    blob[:8] = struct.pack("<Q", len(blob))
    good.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"not a safetensors file \(header length") as err:
        CheckpointSource(good, SPEC)
    assert str(good) in str(err.value)


def test_a_projection_at_an_offset_its_dtype_cannot_sit_at_is_refused(tmp_path: Path) -> None:
    """Legal for the format (safetensors loads it), but a bf16 weight at an odd offset cannot be viewed in place."""
    weights = make_weights(SPEC)
    path = write_safetensors(weights, tmp_path / "odd.safetensors", residues={TARGET: 1})
    assert torch.equal(load_file(str(path))[TARGET], weights[TARGET])
    with pytest.raises(CheckpointError, match=rf"{TARGET}: its data starts at file offset \d+, not a multiple"):
        CheckpointSource(path, SPEC)


def test_legal_but_unusual_headers_are_accepted_and_build_exactly(good: Path) -> None:
    """What safetensors accepts besides its own writer's output: extra fields, null metadata, any key order."""
    header, data = _split(good)
    header[TARGET]["note"] = "an extra field"
    header["__metadata__"] = None
    reordered = dict(reversed(list(header.items())))
    raw = b"  " + json.dumps(reordered).encode()
    path = _join(good.with_name("unusual.safetensors"), raw + b" " * (-len(raw) % 8), data)
    assert not _safetensors_refuses(path)
    cache = AdalnCache(SPEC, CheckpointSource(path, SPEC), max_plans=1, max_plan_width=2)
    cache.build([PLAN], embed=EMBED)
    assert_plan_exact(cache, load_file(str(path)), "native", EMBED, PLAN)


def test_a_header_corrupted_after_construction_fails_the_next_build(good: Path) -> None:
    """The next build re-validates the changed file: BuildError caused by the CheckpointError naming the tensor."""
    cache = AdalnCache(SPEC, CheckpointSource(good, SPEC), max_plans=2, max_plan_width=2)
    cache.build([PLAN], embed=EMBED)
    header, data = _split(good)
    header[TARGET]["data_offsets"] = [float(v) for v in header[TARGET]["data_offsets"]]
    tmp = _join(good.with_name("next.safetensors"), header, data)
    os.replace(tmp, good)
    with pytest.raises(BuildError) as err:
        cache.build([torch.tensor([0.75])], embed=EMBED)
    assert isinstance(err.value.__cause__, CheckpointError)
    assert repr(TARGET) in str(err.value.__cause__)


# -- the public seams ------------------------------------------------------------------------------


def test_read_tensor_reads_any_tensor_at_its_file_alignment(good: Path) -> None:
    source = CheckpointSource(good, SPEC)
    reference = load_file(str(good))
    for name in ("unrelated.weight", TARGET):  # fp32 and bf16
        tensor = source.read_tensor(name)
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name])
        assert tensor.data_ptr() % 4096 == source.entry(name)[1].begin % 4096
    with pytest.raises(CheckpointError, match=r"no tensor 'nope'") as err:
        source.read_tensor("nope")
    assert str(good) in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
@pytest.mark.parametrize("residue", [0, 8, 24])
def test_aligned_empty_places_the_data_at_the_residue(dtype: torch.dtype, residue: int) -> None:
    for modulus in (ALIGNMENT, 4096):
        t = aligned_empty((3, 5), dtype, residue, modulus=modulus)
        assert t.shape == (3, 5) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % modulus == residue
        t.fill_(1)  # the memory is really there


def test_aligned_empty_refuses_a_residue_its_elements_cannot_sit_at() -> None:
    with pytest.raises(ValueError, match="4-byte elements"):
        aligned_empty((4,), torch.float32, 2)


def test_writer_round_trips_through_safetensors_with_lazy_tensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d": torch.tensor([True, False, True]),
        "e": torch.zeros(0, 4),
        "f": torch.tensor(2.5),
    }
    lazy = {name: LazyTensor(tuple(t.shape), t.dtype, lambda t=t: t.clone()) for name, t in tensors.items()}
    residues = {"a": 4, "b": 34, "c": 8, "d": 3}
    for source in (tensors, lazy):
        path = write_safetensors(source, tmp_path / "w.safetensors", residues=residues, metadata={"format": "pt"})
        loaded = load_file(str(path))
        for name, t in tensors.items():
            assert torch.equal(loaded[name], t)
        header, _ = _split(path)
        start = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
        for name, residue in residues.items():
            assert (start + header[name]["data_offsets"][0]) % 64 == residue


# -- fuzz ------------------------------------------------------------------------------------------

_JSON_SCALARS = st.one_of(
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.sampled_from(["BF16", "F16", "F32", "U8", "I16", "F4", "F6_E2M3", "C64", "F8_E8M0", "bf16", ""]),
)
_JSON = st.recursive(_JSON_SCALARS, lambda inner: st.lists(inner, max_size=3), max_leaves=4)


@st.composite
def _mutation(draw: st.DrawFn, names: list[str]) -> tuple[str, Any]:
    kind = draw(
        st.sampled_from(["field", "nudge", "swap", "shape", "dtype", "drop", "rename", "metadata", "byte", "data"])
    )
    name = draw(st.sampled_from(names))
    if kind == "field":
        return kind, (name, draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"])), draw(_JSON))
    if kind == "nudge":
        return kind, (name, draw(st.integers(-4, 4)), draw(st.integers(-4, 4)))
    if kind == "swap":
        return kind, (name, draw(st.sampled_from(names)))
    if kind == "shape":
        return kind, (name, draw(st.sampled_from(["reverse", "flat", "grow", "shrink"])))
    if kind == "dtype":
        return kind, (name, draw(st.sampled_from(["BF16", "F16", "F32", "U8", "I16", "U16", "I64", "F4", "BOOL"])))
    if kind == "metadata":
        return kind, draw(_JSON | st.dictionaries(st.text(max_size=3), _JSON_SCALARS, max_size=2))
    if kind == "byte":
        return kind, (draw(st.integers(0, 10**6)), draw(st.sampled_from(list(b'0123456789,:[]{}"-.eE tfn'))))
    if kind == "data":
        return kind, draw(st.integers(-8, 8))
    return kind, name


def _apply(header: dict[str, Any], raw: bytes | None, data: bytes, mutation: tuple[str, Any]) -> tuple[bytes, bytes]:
    """One mutation of a header (a dict until a byte-level mutation turns it into bytes) and its data."""
    kind, arg = mutation
    if kind == "byte":
        blob = bytearray(raw if raw is not None else json.dumps(header).encode())
        pos, value = arg
        blob[pos % len(blob)] = value
        return bytes(blob), data
    if kind == "data":
        data = data + b"\0" * arg if arg >= 0 else data[:arg]
    elif kind == "metadata":
        header["__metadata__"] = arg
    else:
        name = arg[0] if isinstance(arg, tuple) else arg
        entry = header[name]  # KeyError: an earlier mutation dropped or renamed it
        if kind == "field":
            entry[arg[1]] = arg[2]
        elif kind == "nudge":
            begin, end = entry["data_offsets"]
            entry["data_offsets"] = [begin + arg[1], end + arg[2]]
        elif kind == "swap" and arg[1] in header:
            other = header[arg[1]]
            entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
        elif kind == "shape":
            shape = entry["shape"]
            # Only the chosen change is computed: an earlier mutation may have left a shape that
            # another change cannot take (``[None]`` has a reverse but no product).
            entry["shape"] = {
                "reverse": lambda: shape[::-1],
                "flat": lambda: [math.prod(shape)],
                "grow": lambda: [shape[0] + 1, *shape[1:]],
                "shrink": lambda: [shape[0] - 1, *shape[1:]],
            }[arg[1]]()
        elif kind == "dtype":
            entry["dtype"] = arg[1]
        elif kind == "drop":
            del header[name]
        elif kind == "rename":
            header[name + ".renamed"] = header.pop(name)
    return (raw if raw is not None else json.dumps(header).encode()), data


def _fuzz_once(good: Path, out: Path, mutations: list[tuple[str, Any]]) -> None:
    header, data = _split(good)
    raw: bytes | None = None
    for mutation in mutations:
        try:
            blob, data = _apply(header, raw, data, mutation)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            continue  # an earlier mutation left nothing this one can apply to (the harness, not the code)
        if mutation[0] == "byte":
            raw = blob
    path = _join(out, raw if raw is not None else header, data)
    try:
        source = CheckpointSource(path, SPEC)
    except CheckpointError:
        return
    cache = AdalnCache(SPEC, source, max_plans=1, max_plan_width=2)
    cache.build([PLAN], embed=EMBED)
    assert_plan_exact(cache, load_file(str(path)), "native", EMBED, PLAN)


def _fuzz(examples: int, *, derandomize: bool) -> Callable[..., None]:
    names = sorted(make_weights(SPEC))

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(mutations=st.lists(_mutation(names), min_size=1, max_size=3))
    def run(good: Path, mutations: list[tuple[str, Any]]) -> None:
        _fuzz_once(good, good.with_name("fuzzed.safetensors"), mutations)

    return run


def test_fuzzed_headers_build_exactly_or_raise_checkpoint_error(good: Path) -> None:
    _fuzz(80, derandomize=True)(good)


@pytest.mark.soak
def test_fuzzed_headers_soak(good: Path) -> None:
    """5000 random mutated headers (``make soak``)."""
    _fuzz(5000, derandomize=False)(good)
