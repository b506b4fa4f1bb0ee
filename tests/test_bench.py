"""`ganscale bench ...` end to end at tiny sizes: each writes a well-formed table (Markdown and JSON)
with the machine and the command. No timing is asserted: speed targets live in benchmarks/results/."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ganscale.bench import overhead
from ganscale.bench.report import markdown_table, write_results
from ganscale.cli import main
from ganscale.models import build_networks
from ganscale import config, preflight


def run_bench(tmp_path: Path, *args: str) -> dict:
    """Run `ganscale bench ARGS --out-dir tmp`; check both files and return the JSON record."""
    out = tmp_path / "results"
    result = CliRunner().invoke(main, ["bench", *args, "--out-dir", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (md,), (js,) = sorted(out.glob("bench-*.md")), sorted(out.glob("bench-*.json"))
    assert md.stem == js.stem and md.stem.startswith(f"bench-{args[0]}-")
    record = json.loads(js.read_text())
    assert record["command"] == args[0]
    assert record["command_line"].startswith(f"ganscale bench {args[0]} ")
    assert {"cpu", "cores", "torch", "cuda_device"} <= set(record["machine"])
    assert record["rows"] and all(set(record["columns"]) <= set(row) for row in record["rows"])
    text = md.read_text()
    assert record["command_line"] in text and record["machine"]["cpu"] in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(record["rows"])  # header, rule, one line per row
    assert {line.count("|") for line in table} == {len(record["columns"]) + 1}
    return record


def test_markdown_table_has_one_cell_per_column():
    text = markdown_table(["a", "b"], [{"a": 1.23456789, "b": None}, {"a": "x", "b": 2}])
    assert text.splitlines() == ["| a | b |", "| --- | --- |", "| 1.235 |  |", "| x | 2 |"]


def test_two_results_in_the_same_second_keep_both_files(tmp_path, monkeypatch):
    monkeypatch.setattr("time.gmtime", lambda *args: (2026, 11, 25, 10, 0, 0, 2, 329, 0))  # one second for both
    first = write_results("demo", "ganscale bench demo", ["x"], [{"x": 1}], [], out_dir=tmp_path)
    second = write_results("demo", "ganscale bench demo", ["x"], [{"x": 2}], [], out_dir=tmp_path)
    assert set(first).isdisjoint(second)
    assert [json.loads(path.read_text())["rows"] for path in (first[1], second[1])] == [[{"x": 1}], [{"x": 2}]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (*first, *second))  # no temporaries


def test_plain_loop_trains_the_recipes_networks():
    cfg = config.load("digits", overhead.TRAINER_OVERRIDES)
    plain = overhead.PlainDCGAN(cfg, torch.rand(100, 1, 8, 8) * 2 - 1)
    G, D = build_networks(cfg)
    assert all(torch.equal(a, b) for a, b in zip(plain.G.state_dict().values(), G.state_dict().values()))
    loss_d, loss_g = plain.step()
    assert math.isfinite(loss_d) and math.isfinite(loss_g)
    assert not torch.equal(plain.D.net[0].weight, D.net[0].weight)  # D stepped
    assert not torch.equal(plain.G_ema.net[0].weight, G.net[0].weight)  # EMA followed G


def test_overhead_alternates_blocks_and_writes_the_ratio(tmp_path):
    record = run_bench(tmp_path, "overhead", "--steps", "3", "--repeats", "2", "--warmup", "2")
    for clock in ("wall", "cpu"):
        result = record["result"][clock]
        assert result["timed_steps"] == [6, 6] and len(result["block_ratios"]) == 2
        assert result["ratio"] == pytest.approx(result["ganscale_median_s"] / result["plain_median_s"])
    assert [row["loop"] for row in record["rows"]] == ["plain PyTorch", "ganscale Trainer"]
    assert "--steps 3 --repeats 2 --warmup 2" in record["command_line"]


def test_throughput_counts_flops_and_mfu_against_the_given_peak(tmp_path):
    record = run_bench(tmp_path, "throughput", "--device", "cpu", "--batch", "2", "--batch", "4", "--resolution", "8",
                       "--dcgan-width", "8", "--biggan-ch", "4", "--iters", "1", "--warmup", "1", "--peak-tflops", "1")
    rows = record["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [("dcgan", 2), ("dcgan", 4), ("biggan", 2), ("biggan", 4)]
    for row in rows:
        assert row["gflop_per_iter"] > 0 and row["img_per_s"] > 0
        assert row["mfu"] == pytest.approx(row["achieved_tflops"] / 1.0)
    # Convolution FLOPs grow with the batch: twice the images, about twice the FLOPs.
    assert rows[1]["gflop_per_iter"] == pytest.approx(2 * rows[0]["gflop_per_iter"], rel=0.05)


def test_throughput_runs_bf16_autocast(tmp_path):
    record = run_bench(tmp_path, "throughput", "--device", "cpu", "--batch", "2", "--resolution", "8", "--dcgan-width", "8",
                       "--biggan-ch", "4", "--iters", "1", "--warmup", "1", "--precision", "bf16")
    assert {row["precision"] for row in record["rows"]} == {"bf16"} and all(r["gflop_per_iter"] > 0 for r in record["rows"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_throughput_on_cuda_without_a_gpu_exits_2_naming_the_option(tmp_path):
    result = CliRunner().invoke(main, ["bench", "throughput", "--device", "cuda", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "config error at '--device': cuda: no CUDA device is visible" in result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_throughput_on_cuda_reports_mfu_against_the_gpus_bf16_peak(tmp_path):
    from ganscale.bench.throughput import gpu_peak_tflops

    peak = gpu_peak_tflops(torch.cuda.get_device_name(), "bf16")
    record = run_bench(tmp_path, "throughput", "--device", "cuda", "--batch", "2", "--resolution", "8",
                       "--dcgan-width", "8", "--biggan-ch", "4", "--iters", "1", "--warmup", "1",
                       *([] if peak else ["--peak-tflops", "100"]))
    for row in record["rows"]:
        assert row["precision"] == "bf16" and row["peak_tflops"] == (peak or 100)
        assert 0 < row["mfu"] < 1 and row["max_memory_allocated_bytes"] > 0


def test_the_mfu_peak_is_the_named_gpus():
    """H100 SXM, PCIe and NVL differ by a third: one peak for all made MFU wrong on two of them, silently."""
    from ganscale.bench.throughput import gpu_peak_tflops

    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0 and gpu_peak_tflops("NVIDIA H100 NVL", "fp32") == 60.0
    assert gpu_peak_tflops("NVIDIA H200", "fp32") == 67.0 and gpu_peak_tflops("NVIDIA H200 NVL", "bf16") == 835.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert gpu_peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None


@pytest.mark.slow
def test_strategies_reads_step_time_memory_and_traffic_from_real_runs(tmp_path):
    record = run_bench(tmp_path, "strategies", "--model", "mlp", "--steps", "5", "--batch", "8",
                       "--strategy", "ddp", "--strategy", "fsdp")
    ddp, fsdp = record["runs"]
    assert ddp["world_size"] == fsdp["world_size"] == 2
    assert ddp["comm_bytes_by_kind"].get("all_reduce", 0) > 0 and fsdp["comm_bytes_by_kind"].get("all_gather", 0) > 0
    assert fsdp["optimizer_bytes_max_rank"] < ddp["optimizer_bytes_max_rank"]  # sharded state shows up
    assert all(t > 0 for run in (ddp, fsdp) for t in run["step_times_s"])


def test_each_bench_model_is_its_recipe_and_valid_under_two_process_ddp():
    from ganscale.bench.strategies import MODELS

    for name, (recipe, base) in MODELS.items():
        cfg = config.load(recipe, [*base, "parallel.generator=ddp", "parallel.discriminator=ddp", "train.batch_size=16"])
        preflight.check(cfg, 2, False)
        assert cfg.model.kind == name


@pytest.mark.slow
def test_scaling_compares_one_process_with_two(tmp_path):
    record = run_bench(tmp_path, "scaling", "--model", "mlp", "--per-rank-batch", "8", "--steps", "6", "--repeats", "1")
    one, two, apart = record["rows"]
    assert (one["global batch"], two["global batch"], apart["global batch"]) == (8, 16, 8)
    assert record["result"]["independent"]["steps_measured"] == 2 * (6 - 3)  # both processes' steps
    result = record["result"]
    assert result["one_process"]["steps_measured"] == 6 - 3 and result["n_process"]["steps_measured"] == 2 * (6 - 3)
    assert result["wall_ratio"] == pytest.approx(two["median wall (ms)"] / one["median wall (ms)"])
    assert result["pair_wall_ratios"] == [pytest.approx(result["wall_ratio"])]  # one pair: the same two runs
    assert result["n_process"]["cpu_median_s"] > 0


@pytest.mark.slow
def test_pix2pix_table_runs_each_row_as_a_training_and_skips_cuda_only_rows(tmp_path):
    record = run_bench(tmp_path, "pix2pix-table", "--images", "2", "--epochs", "2", "--device", "cpu", "--threads", "1",
                       "--rows", "baseline,accumulation-4,fsdp-offload")
    baseline, accumulation, offload = record["rows"]
    assert baseline["status"] == accumulation["status"] == "ok"
    assert (baseline["global batch"], baseline["steps/epoch"]) == (1, 2)    # batch 1: one step per image
    assert (accumulation["global batch"], accumulation["steps/epoch"]) == (4, 1)  # at least one step per epoch
    for row in (baseline, accumulation):
        assert len(row["epoch_s"]) == 2 and all(t > 0 for t in row["epoch_s"])
        assert row["epoch median s"] == row["epoch_s"][1]  # later epochs only: the first carries start-up
        assert math.isfinite(row["loss_d"]) and math.isfinite(row["loss_g"]) and row["peak MiB"] > 0
        assert 0 <= row["data wait %"] < 100
    assert offload["status"].startswith("skipped") and offload["epoch median s"] is None
    assert baseline["document s/epoch"] == 40.38


def test_pix2pix_table_names_an_unknown_row(tmp_path):
    result = CliRunner().invoke(main, ["bench", "pix2pix-table", "--rows", "baseline,warp-speed", "--out-dir",
                                       str(tmp_path)])
    assert result.exit_code == 2 and "warp-speed" in result.output and "--rows" in result.output
    assert not list(tmp_path.iterdir())


def test_pix2pix_table_names_an_empty_rows_list(tmp_path, monkeypatch):
    from ganscale.bench import pix2pix

    def no_training(*args):
        raise AssertionError("an empty --rows ran a row")
    monkeypatch.setattr(pix2pix, "run_training", no_training)
    for rows in ("", "baseline,"):
        result = CliRunner().invoke(main, ["bench", "pix2pix-table", "--rows", rows, "--out-dir", str(tmp_path)])
        assert result.exit_code == 2 and "--rows" in result.output and "empty row" in result.output, result.output
    assert not list(tmp_path.iterdir())


def test_pix2pix_table_on_a_folder_that_is_not_a_paired_set_exits_2_naming_data(tmp_path):
    from PIL import Image

    square = tmp_path / "good"
    square.mkdir()
    Image.new("RGB", (32, 32)).save(square / "0.png")
    result = CliRunner().invoke(main, ["bench", "pix2pix-table", "--data", str(square), "--device", "cpu",
                                       "--out-dir", str(tmp_path / "results")])
    assert result.exit_code == 2 and not isinstance(result.exception, config.ConfigError), result.output
    assert result.output.startswith("ganscale: config error at '--data':") and "0.png is 32x32" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()


def test_pix2pix_table_shows_a_failed_row_s_output_writes_the_table_and_exits_1(tmp_path, monkeypatch):
    from ganscale.bench import pix2pix
    from ganscale.bench.strategies import RunFailed

    def failing(recipe, overrides, nproc, run_dir, threads, timeout_s):
        raise RunFailed("`train pix2pix` exited 1:\nTraceback (most recent call last):\n"
                        "OSError: cannot read image broken/0000.jpg: image file is truncated\n"
                        "ganscale: worker rank 0 failed with exit code 1 (see its output above)")
    monkeypatch.setattr(pix2pix, "run_training", failing)
    out = tmp_path / "results"
    result = CliRunner().invoke(main, ["bench", "pix2pix-table", "--images", "2", "--epochs", "2", "--device", "cpu",
                                       "--threads", "1", "--rows", "baseline,fsdp-offload", "--out-dir", str(out)])
    assert result.exit_code == 1, result.output
    assert "OSError: cannot read image broken/0000.jpg" in result.stderr  # the run's own words, not only its last line
    assert "1 of 2 row(s) failed (baseline)" in result.stderr
    (js,) = out.glob("bench-pix2pix-table-*.json")  # the table is still written
    assert len(list(out.glob("bench-pix2pix-table-*.md"))) == 1
    baseline, offload = json.loads(js.read_text())["rows"]
    assert baseline["status"].startswith("failed") and "cannot read image" in baseline["output"]
    assert offload["status"].startswith("skipped")  # a skipped row is no failure


def test_throughput_of_stylegan2_counts_its_flops(tmp_path):
    record = run_bench(tmp_path, "throughput", "--device", "cpu", "--model", "stylegan2", "--batch", "4", "--batch", "8",
                       "--resolution", "8", "--stylegan2-base", "64", "--iters", "1", "--warmup", "1")
    rows = record["rows"]
    assert [(r["model"], r["batch"], r["width"]) for r in rows] == [("stylegan2", 4, 64), ("stylegan2", 8, 64)]
    assert rows[0]["params_G"] > 0 and rows[0]["mfu"] is None  # no peak on the CPU unless given
    # Per sample: modulated convolutions and the mapping; per forward, whatever the batch: w_avg's refresh (the
    # mapping of 256 fixed latents). Twice the batch: more FLOPs, less than twice.
    assert rows[0]["gflop_per_iter"] < rows[1]["gflop_per_iter"] < 2 * rows[0]["gflop_per_iter"]


@pytest.mark.parametrize("model, resolution, problem", [
    ("dcgan", "12", "DCGAN needs a power-of-two resolution, got 12"),
    ("dcgan", "48", "DCGAN needs a power-of-two resolution, got 48"),
    ("stylegan2", "12", "StyleGAN2 has no layout for resolution 12"),
    ("biggan", "12", "BigGAN has no layout for resolution 12")])
def test_throughput_refuses_a_resolution_the_model_has_no_layout_for_in_one_line(tmp_path, model, resolution, problem):
    result = CliRunner().invoke(main, ["bench", "throughput", "--device", "cpu", "--batch", "2", "--iters", "1",
                                       "--warmup", "1", "--model", model, "--resolution", resolution,
                                       "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"ganscale: config error at '--resolution': {problem}. Fix: use ")
    assert not (tmp_path / "out").exists()


def test_throughput_refuses_the_resolution_train_refuses_with_train_s_message(tmp_path):
    bench = CliRunner().invoke(main, ["bench", "throughput", "--device", "cpu", "--model", "dcgan", "--resolution",
                                      "12", "--out-dir", str(tmp_path / "out")])
    with pytest.raises(config.ConfigError) as train:
        preflight.check(config.load("digits", ["data.resolution=12"]), 1, False)
    assert bench.exit_code == 2
    assert bench.output.strip() == f"ganscale: {config.ConfigError('--resolution', train.value.problem, train.value.fix)}"


@pytest.mark.parametrize("peak", ["-1", "0"])
def test_throughput_refuses_a_peak_that_is_not_positive(tmp_path, peak):
    result = CliRunner().invoke(main, ["bench", "throughput", "--device", "cpu", "--peak-tflops", peak,
                                       "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--peak-tflops" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("nproc, batch", [("3", "8"), ("2", "3")])
def test_strategies_refuses_a_batch_the_processes_cannot_split_before_any_run(tmp_path, monkeypatch, nproc, batch):
    from ganscale.bench import strategies

    def no_run(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(strategies, "train_run", no_run)
    result = CliRunner().invoke(main, ["bench", "strategies", "--nproc", nproc, "--batch", batch, "--steps", "5",
                                       "--strategy", "ddp", "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"ganscale: config error at '--batch': global batch {batch} is not divisible by "
                                     f"world size {nproc}. Fix: make --batch a multiple of {nproc}")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_strategies_on_cuda_without_a_gpu_exits_2_before_any_run(tmp_path, monkeypatch):
    from ganscale.bench import strategies

    def no_run(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(strategies, "train_run", no_run)
    result = CliRunner().invoke(main, ["bench", "strategies", "--device", "cuda", "--steps", "5", "--strategy", "ddp",
                                       "--out-dir", str(tmp_path / "out")])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "ganscale: config error at '--device': cuda: no CUDA device is visible. Fix: use --device cpu"]
    assert not (tmp_path / "out").exists()
