"""The kernel benchmark's logic and JSON schema on a toy shape (not a timing test)."""

import argparse
import json
import os

import numpy as np
import pytest

from bench import kernels as bench_kernels
from bench import machine_facts
from cli.commands import bench
from runtime.kernels import reference

TOY = bench_kernels.LayerShape(c=2, k=3, r=3, s=2, p=4, q=3)


def test_report_has_the_design_schema():
    report = bench_kernels.run_benchmark(
        batches=(2,),
        repeat=1,
        impls=("legion-nn", "numpy"),
        shape=TOY,
        sgemm_size=64,
        peer_repeat=1,
        rounds=2,
        bandwidth_megabytes=4,
    )
    json.dumps(report)
    assert report["sgemm_gflops"] > 0
    assert len(report["results"]) == 2 * 2 * 3  # impls x (untied, tied) x passes
    for res in report["results"]:
        assert set(res) >= {"op", "pass", "impl", "untied", "shape", "gflops"}
        assert res["pass"] in ("forward", "backward_data", "backward_filter")
        assert res["impl"] in ("legion-nn", "numpy")
        assert res["shape"] == {"N": 2, "C": 2, "K": 3, "R": 3, "S": 2, "P": 4, "Q": 3}
        assert res["gflops"] > 0
    ours = [res for res in report["results"] if res["impl"] == "legion-nn"]
    for res in ours:
        assert res["cpu_user_s"] >= 0 and res["cpu_system_s"] >= 0 and res["page_faults"] >= 0
        assert res["gbytes_per_s"] == pytest.approx(res["bytes"] / res["seconds"] / 1e9)
        assert res["bound"] in ("compute", "memory", "system")
    assert report["memory_gbytes_per_s"] > 0
    facts = report["machine"]
    assert facts["cores"] == os.cpu_count() and facts["cpu"] and facts["numba"]
    assert report["torch_sgemm_gflops"] is None  # PyTorch not measured
    assert set(report["blas"]) == {"kernels", "ceiling"}
    table = bench_kernels.format_table(report)
    assert "SGEMM ceiling" in table and table.count("untied") == 3
    assert table.startswith(f"machine: {facts['cpu']}") and "copy bandwidth" in table
    head = next(line for line in table.splitlines() if line.startswith("pass"))
    assert head.split()[-4:] == ["sys%", "faults", "GB/s", "bound"]
    assert f"BLAS: kernels {report['blas']['kernels']}" in table
    assert "PyTorch's own SGEMM" not in table
    report["torch_sgemm_gflops"] = 123.4
    assert "PyTorch's own SGEMM (torch.mm, same size): 123.4" in bench_kernels.format_table(report)


def _ours_on_the_toy_shape() -> dict:
    """One quick sweep of our kernels alone on `TOY`, with small ceilings."""
    return bench_kernels.run_benchmark(
        batches=(2,),
        repeat=1,
        impls=("legion-nn",),
        shape=TOY,
        sgemm_size=64,
        rounds=1,
        bandwidth_megabytes=4,
    )


def test_a_pinned_core_type_is_lifted_for_the_ceiling(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    native = bench_kernels.sgemm_native(size=64, repeat=1)
    assert native["gflops"] > 0 and native["blas"].endswith(" kernels"), native
    report = _ours_on_the_toy_shape()
    runs = (report["sgemm_configured_gflops"], report["sgemm_native"]["gflops"])
    assert report["sgemm_gflops"] == max(runs)
    table = bench_kernels.format_table(report)
    assert "without OPENBLAS_CORETYPE=Haswell (" in table and "as configured (" in table
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    assert bench_kernels.sgemm_native(size=64, repeat=1) is None


def test_a_failed_native_ceiling_is_reported_not_hidden(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setattr(bench_kernels.sys, "executable", "false")
    with pytest.raises(RuntimeError, match="exit 1"):
        bench_kernels.sgemm_native(size=64, repeat=1)
    report = _ours_on_the_toy_shape()
    assert report["sgemm_native"] is None
    assert report["sgemm_gflops"] == report["sgemm_configured_gflops"]
    assert report["skipped"] == ["SGEMM without OPENBLAS_CORETYPE (exit 1)"]


def test_the_kernels_blas_is_named_with_its_core_type():
    blas = machine_facts.blas_in_use()
    assert blas["kernels"] != "unknown" and blas["kernels"].endswith(" kernels"), blas


@pytest.mark.parametrize("untied", [True, False])
def test_torch_peers_compute_the_same_passes(untied):
    pytest.importorskip("torch")
    x, w, dy = bench_kernels._operands(TOY, 2, untied)
    got = {name: fn() for name, fn in bench_kernels._torch(x, w, dy, untied).items()}
    np.testing.assert_allclose(got["forward"].numpy(), reference.filter_forward(x, w), atol=1e-4)
    np.testing.assert_allclose(
        got["backward_data"].numpy(), reference.filter_backward_data(dy, x.shape, w), atol=1e-4
    )
    dw = reference.filter_backward_filter(dy, x, w.shape)[:, 0, 0]  # (K, C, R, S, P, Q)
    if untied:
        dw = dw.transpose(4, 5, 0, 1, 2, 3).reshape(TOY.p * TOY.q, TOY.k, -1)
    else:
        dw = dw[..., 0, 0]
    np.testing.assert_allclose(got["backward_filter"].numpy(), dw, atol=1e-4)


def test_command_arguments():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["kernels", "--batch", "8", "16", "--impl", "numpy"])
    assert (
        args.batch == [8, 16]
        and args.impl == ["numpy"]
        and args.repeat == 3
        and args.rounds == 3
        and args.peer_repeat == 2
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["kernels", "--batch", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["layers"])


def test_unwritable_json_fails_before_measuring(monkeypatch, capsys, tmp_path):
    from cli import main as command_line

    monkeypatch.setattr(command_line, "COMMANDS", ("bench",))
    target = tmp_path / "missing" / "bench.json"
    assert command_line.main(["bench", "kernels", "--json", str(target)]) == 2
    assert "--json: cannot write" in capsys.readouterr().err


def test_a_pass_is_bound_by_what_takes_its_time():
    costs = bench_kernels.CallCosts
    assert bench_kernels.bound(costs(1.0, 0.1, 0), 1.0, 100.0) == "system"  # 9% in the kernel
    assert bench_kernels.bound(costs(1.0, 0.01, 0), 60.0, 100.0) == "memory"
    assert bench_kernels.bound(costs(1.0, 0.01, 0), 10.0, 100.0) == "compute"


def test_the_costs_of_a_call_count_its_page_faults():
    size = 64 << 20  # past glibc's largest mmap threshold: mapped afresh by every call
    fresh_seconds, fresh = bench_kernels.measured(lambda: np.ones(size // 8), 3)
    kept = np.empty(size // 8)
    kept_seconds, reused = bench_kernels.measured(lambda: kept.fill(1.0), 3)
    assert fresh.page_faults >= size / (2 << 20)  # at least a fault per huge page
    assert reused.page_faults < fresh.page_faults / 4
    assert min(fresh_seconds, kept_seconds) > 0 and fresh.user_s + fresh.system_s > 0


def test_a_pass_moves_its_operands_and_result():
    x, w, dy = bench_kernels._operands(TOY, 2, untied=True)
    moved = bench_kernels.pass_bytes(x, w, dy)
    assert set(moved) == set(bench_kernels.PASSES)
    assert all(b == x.nbytes + w.nbytes + dy.nbytes for b in moved.values())


def test_the_last_level_cache_is_the_largest_listed_and_a_default_where_none_is(tmp_path):
    for index, size in enumerate(("48K", "1024K", "32768K", "garbage")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert machine_facts.last_level_cache_bytes(tmp_path) == 32 << 20
    assert (
        machine_facts.last_level_cache_bytes(tmp_path / "missing")
        == machine_facts.FALLBACK_LAST_LEVEL_CACHE_BYTES
    )


def test_our_share_of_sgemm_pairs_each_pass_with_the_sgemm_beside_it(monkeypatch):
    ceilings = iter([100.0, 200.0, 400.0, 100.0, 50.0, 300.0, 100.0, 100.0, 1000.0])
    monkeypatch.setattr(bench_kernels, "sgemm_gflops", lambda *a, **k: next(ceilings, 100.0))
    monkeypatch.setattr(bench_kernels, "sgemm_native", lambda *a, **k: None)
    seconds = TOY.flops(2) / 1e9 / 100.0  # every pass at 100 GFLOP/s
    monkeypatch.setattr(
        bench_kernels, "measured", lambda fn, times: (seconds, bench_kernels.CallCosts(1, 0, 0))
    )
    report = bench_kernels.run_benchmark(
        batches=(2,), repeat=1, impls=("legion-nn",), shape=TOY, sgemm_size=64, rounds=2,
        bandwidth_megabytes=4,
    )  # fmt: skip
    # sgemm_gflops is asked at the start, then before each of the two layers and after each
    # of their three passes: (100), then [200, 400, 100, 50] untied, [300, 100, 100, 1000] tied
    by_pass = {(r["untied"], r["pass"]): r for r in report["results"]}
    untied = [by_pass[True, p]["sgemm_shares"][0] for p in bench_kernels.PASSES]
    assert untied == pytest.approx([100 / 400, 100 / 400, 100 / 100])
    tied = [by_pass[False, p]["sgemm_shares"][0] for p in bench_kernels.PASSES]
    assert tied == pytest.approx([100 / 300, 100 / 100, 100 / 1000])
    for res in report["results"]:  # the second round's ceilings are all 100
        assert res["sgemm_shares"][1] == pytest.approx(1.0)
        assert res["sgemm_share"] == pytest.approx(np.median(res["sgemm_shares"]))
    assert report["sgemm_gflops"] == 1000.0
    table = bench_kernels.format_table(report)
    row = next(line for line in table.splitlines() if line.startswith("forward         untied"))
    assert row.split()[4] == f"{(0.25 + 1.0) / 2:.0%}"  # the paired median, not 100 / 1000
    assert "%SGEMM: the median over rounds" in table


def test_paired_rates_are_scaled_by_how_much_faster_the_unpinned_kernels_ran():
    assert bench_kernels.unpinned_scale(None, [100.0, 150.0]) == 1.0  # nothing pinned
    assert bench_kernels.unpinned_scale({"gflops": 300.0}, [100.0, 150.0]) == 2.0
    assert bench_kernels.unpinned_scale({"gflops": 100.0}, [150.0]) == 1.0  # never below
