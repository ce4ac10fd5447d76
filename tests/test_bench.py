"""``adalncache bench`` runs end to end on a tiny geometry and writes its JSON, Markdown and chart.

No timing assertions: speed is only measured by the benchmark itself, side by side, as ratios.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adalncache.cli import main


@pytest.mark.slow
def test_bench_quick_tiny_geometry_writes_results(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    out = tmp_path / "results"
    argv = [
        "bench",
        "--quick",
        "--layers",
        "1",
        "--hidden",
        "8",
        "--in-features",
        "16",
        "--plans",
        "3",
        "--size",
        "tiny",
        "--dir",
        str(tmp_path / "work"),
        "--out",
        str(out),
        # The deploy section has its own test (its fresh processes would double this one's time).
        "--only",
        "pass",
        "forward",
        "build",
        "store",
        "memory",
    ]
    assert main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    names = [c["name"] for c in data["comparisons"]]
    assert any(name.startswith("pass vs max(read, project)") for name in names)
    assert any(name.startswith("pass vs naive") for name in names)
    assert any(name.startswith("forward step") for name in names)
    assert any(name.startswith("build() of a fully resident") for name in names)
    assert any(name.startswith("peak anonymous memory") for name in names)
    for comparison in data["comparisons"]:
        assert comparison["ratio"] > 0
    assert data["values"]["forward"]["cached_bit_identical"] is True
    markdown = (out / "bench.md").read_text()
    assert "| comparison |" in markdown and "pass vs naive" in markdown
    assert (out / "bench.png").stat().st_size > 0


def test_bench_pass_section_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    argv = [
        "bench",
        "--quick",
        "--layers",
        "1",
        "--hidden",
        "8",
        "--in-features",
        "16",
        "--plans",
        "2",
        "--only",
        "pass",
        "--no-cold",
        "--dir",
        str(tmp_path / "work"),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    names = [c["name"] for c in data["comparisons"]]
    prefixes = (
        "pass vs max(read, project)",
        "first pass (fresh buffers)",
        "pass vs read and project run",
        "batched pass vs",
        "pass vs naive",
        "in-place pass vs staged pass",
        "tiled pass vs per-plan pass",
        "default pass vs staged per-plan pass",
        "pass vs SGLang",
    )
    assert names and all(n.startswith(prefixes) for n in names)
    for row in ("in-place pass vs staged pass", "tiled pass vs per-plan pass", "default pass vs staged per-plan"):
        assert any(n.startswith(row) for n in names)
    assert set(data["values"]["pass_fast_warm_s"]) >= {"staged", "inplace", "tiled"}
    assert data["values"]["batched"]["bit_identical"] is True
    # The physical limit of a CUDA pass is measured there only; on a CPU the run says so.
    assert any("pinned host-to-device copy: measured on a CUDA device only" in note for note in data["notes"])
    assert "pinned_h2d_s" not in data["values"]
    printed = capsys.readouterr().out
    assert "pass vs naive" in printed and "x" in printed


def test_the_pinned_copy_needs_cuda() -> None:
    from adalncache.tools.bench.primitives import PinnedCopy

    with pytest.raises(ValueError, match="needs a CUDA device"):
        PinnedCopy(object(), torch.device("cpu"))


def test_bench_rejects_a_device_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = [
        "bench",
        "--quick",
        "--layers",
        "1",
        "--hidden",
        "8",
        "--in-features",
        "16",
        "--device",
        "cuda",
        "--dir",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "--device cpu" in err
    assert not (tmp_path / "out").exists()  # rejected before any work


def test_bench_hit_path_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The hit path: ``build()`` and ``resolve_slots()`` of a fully resident request, 49 and 10 plans, per plan."""
    from adalncache.tools.bench.primitives import load_sglang_cache

    out = tmp_path / "results"
    argv = ["bench", "--quick", "--only", "build", "--dir", str(tmp_path / "work"), "--out", str(out)]
    assert main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    rows = data["values"]["hit_path"]["rows"]
    calls = {(row["call"], row["plans"]) for row in rows}
    assert {("build()", 49), ("build()", 10), ("resolve_slots()", 49), ("resolve_slots()", 10)} <= calls
    for row in rows:
        assert row["adalncache_per_plan_s"] * row["plans"] == pytest.approx(row["adalncache_s"])
    printed = capsys.readouterr().out
    assert "hit path of a fully resident request" in printed and "per plan" in printed
    baseline = load_sglang_cache()
    if isinstance(baseline, str):  # no SGLang here: said so, and only this package's numbers
        assert "SGLang baseline not available" in printed and all("sglang_s" not in row for row in rows)
    else:  # an installed SGLang: timed side by side on the same tables
        assert "tables bit-identical: True" in printed and all(row["ratio"] > 0 for row in rows)
    assert "Hit path of a fully resident request" in (out / "bench.md").read_text()


def test_sglang_stubs_leave_no_trace() -> None:
    """The stubs of SGLang's runtime exist only while its cache module loads."""
    import sys

    from adalncache.tools.bench.primitives import _runtime_stubs, _stubbed, load_sglang_cache

    before = {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")}
    with _stubbed(_runtime_stubs()):
        from sglang.multimodal_gen.runtime.distributed import get_tp_world_size

        assert get_tp_world_size() == 1
    assert {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")} == before
    loaded = load_sglang_cache()
    assert isinstance(loaded, str) or hasattr(loaded[0], "MiniMaxH3AdalnCache")
    assert {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")} == before


@pytest.mark.slow
def test_bench_deploy_section_measures_what_the_load_never_reads(tmp_path: Path) -> None:
    """Fresh processes, page cache dropped: load_transformer reads no served byte, holds less at its
    peak than a stock load + enable, and group offloading onloads exactly the served bytes less."""
    pytest.importorskip("diffusers")
    out = tmp_path / "results"
    assert main(["bench", "--only", "deploy", "--quick", "--size", "small", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    deploy = data["values"]["deploy"]
    served, total = deploy["served_bytes"], deploy["checkpoint_bytes"]
    new, stock = deploy["probes"]["load_transformer"], deploy["probes"]["stock"]
    assert new["passes"] == stock["passes"] == 1
    if new["dropped"] and stock["dropped"]:
        assert new["served_resident_after_load"] == 0
        assert stock["served_resident_after_load"] > served // 2  # the measurement sees what it looks for
        if new["load_read_bytes"] is not None:
            assert new["load_read_bytes"] <= total - served + (1 << 20)
            assert stock["load_read_bytes"] >= total - (1 << 20)
    if new["peak_resettable"] and stock["peak_resettable"]:
        assert new["peak"] < stock["peak"] - 0.4 * served, (new["peak"], stock["peak"], served)
    onloads = deploy["onloaded_per_forward"]
    assert onloads["without"] - onloads["with"] == served
    names = [c["name"] for c in data["comparisons"]]
    assert any(n.startswith("peak resident memory of load + enable") for n in names)
    assert any(n.startswith("checkpoint bytes read by the load") for n in names)
    assert any(n.startswith("bytes onloaded per forward by group offloading") for n in names)
    rows = {row["placement"]: row for row in deploy["card_table"]}
    assert rows["resident"]["with_cache_bytes"] < rows["resident"]["without_cache_bytes"]
    assert any("arithmetic, not measurement" in note for note in data["notes"])


def test_bench_qwen_pass_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Qwen-Image checkpoint written by the bench, one pass of a 50-step request's plans against its GEMMs.

    ``--hidden`` shrinks the released width (3072) so the test stays quick; the tables are
    checked ``torch.equal`` to ``F.linear`` of the file's own weights.
    """
    pytest.importorskip("diffusers")
    from adalncache import ModulationSpec
    from adalncache.tools.bench.workload import qwen_spec

    out, work = tmp_path / "results", tmp_path / "work"
    argv = [
        "bench",
        "--only",
        "qwen-pass",
        "--hidden",
        "8",
        "--plans",
        "6",
        "--runs",
        "1",
        "--dir",
        str(work),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    values = data["values"]["qwen_pass"]
    assert values["tables_equal_linear"] is True and values["passes"] == 1
    # the config block describes the Qwen-Image checkpoint the section ran on, no MiniMax-H3 geometry
    assert data["config"]["spec"] is None and data["config"]["checkpoint"] is None
    assert data["config"]["qwen_pass"]["spec"]["family"] == "qwen-image"
    assert (values["blocks"], values["dim"], values["layers"], values["plans"]) == (2, 8, 5, 6)
    (row,) = data["comparisons"]
    assert row["name"].startswith("Qwen-Image pass vs plain GEMMs, 2 blocks at dim 8, 6 plan(s)") and row["ratio"] > 0
    checkpoint = work / "qwen-2x8"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["_class_name"] == "QwenImageTransformer2DModel"
    assert ModulationSpec.from_checkpoint(checkpoint) == qwen_spec(2, 8)  # the family read back from the files
    assert "tables torch.equal to F.linear of the file's weights: True" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_first_request_section_compares_overlapped_and_sequential(tmp_path: Path) -> None:
    """The first-request row: both pipelines' latents torch.equal, the overlapped one ran two transactions."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    out = tmp_path / "results"
    assert main(["bench", "--only", "first-request", "--quick", "--size", "tiny", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    values = data["values"]["first_request"]
    assert values["latents_bit_identical"] is True
    # Per pipeline: the exactness run, then one cold timed run; overlapped is two transactions each time.
    assert values["passes"] == {"sequential": 2, "overlapped": 4}
    rows = [c for c in data["comparisons"] if c["name"].startswith("first request, encode + pass + first step")]
    assert [(row["subject"], row["baseline"]) for row in rows] == [
        ("overlapped", "sequential"),
        ("early", "sequential"),
        ("early", "late"),
    ]
    qwen = data["values"]["first_request_qwen"]
    assert qwen["latents_bit_identical"] is True and qwen["size"] == "tiny"
    # The two overlapped pipelines ran the same requests on the same checkpoint: the same passes; the
    # sequential one a pass per request (the exactness run, the timed run).
    assert qwen["passes"]["early"] == qwen["passes"]["late"] and qwen["passes"]["sequential"] == 2
    assert qwen["parts_s"]["encode"] > 0 and qwen["parts_s"]["pass"] > 0
    assert "pass started before the prompt is encoded" in (out / "bench.md").read_text()
