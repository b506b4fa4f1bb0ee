"""`ganscale bench ...`: each command prints a Markdown table and writes it as Markdown and JSON to
benchmarks/results/ (or --out-dir), with the machine and the exact command."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import click

from ganscale.bench.report import RESULTS_DIR, markdown_table, write_results
from ganscale.bench.strategies import MODELS

OUT_DIR = click.option("--out-dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR), show_default=True,
                       help="Where the Markdown and JSON results go.")
THREADS = click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
                       help="CPU threads per process (torch.set_num_threads / OMP_NUM_THREADS).")


def refuse_at(option: str, error, fix: str | None = None) -> NoReturn:
    """Exit 2 with a config error said at this command's option (the runs it starts know it by a config key)."""
    from ganscale.config import ConfigError
    from ganscale.fault import EXIT_CONFIG

    click.echo(f"ganscale: {ConfigError(option, error.problem, error.fix if fix is None else fix)}", err=True)
    sys.exit(EXIT_CONFIG)


def refuse_invisible_cuda(device: str | None) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        from ganscale.config import ConfigError

        refuse_at("--device", ConfigError("--device", "cuda: no CUDA device is visible", "use --device cpu"))


def command_line(ctx: click.Context) -> str:
    """The command with every option spelled out (defaults included), so it reruns the same benchmark."""
    words = ["ganscale", "bench", ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or param.name == "out_dir":
            continue
        if getattr(param, "is_flag", False):
            words += [param.opts[0]] if value else []
            continue
        for one in (value if param.multiple else [value]):
            words += [param.opts[0], str(one)]
    return " ".join(words)


def publish(ctx: click.Context, command: str, columns: list[str], rows: list[dict], notes: list[str],
            extra: dict | None = None) -> None:
    click.echo(markdown_table(columns, rows))
    for note in notes:
        click.echo(f"- {note}")
    md, js = write_results(command, command_line(ctx), columns, rows, notes, extra, Path(ctx.params["out_dir"]))
    click.echo(f"wrote {md} and {js}")


@click.group()
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmarks: trainer overhead, model throughput, parallel strategies, DDP scaling, the pix2pix table."""
    from ganscale.fault import terminate_unwinds

    ctx.with_resource(terminate_unwinds())  # a SIGTERM stops the trainings a benchmark started, and its scratch goes


@bench.command()
@click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True, help="Steps per block.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Blocks of each loop, alternating.")
@click.option("--warmup", type=click.IntRange(min=1), default=20, show_default=True, help="Untimed steps of each loop.")
@click.option("--batch", type=click.IntRange(min=1), default=None, help="Global batch (default: the recipe's, 64).")
@click.option("--profile", is_flag=True, help="Also print the trainer's cProfile (by own time), timed steps only.")
@OUT_DIR
@click.pass_context
def overhead(ctx: click.Context, steps: int, repeats: int, warmup: int, batch: int | None, profile: bool,
             out_dir: str) -> None:
    """ganscale's trainer against a hand-written loop: the digits DCGAN, one process, one thread, fp32."""
    import torch

    from ganscale.bench import overhead as bench_overhead

    torch.set_num_threads(1)
    result = bench_overhead.measure(steps, repeats, warmup, batch, profile=profile)
    ctx.params["batch"] = result["batch"]
    wall, cpu = result["wall"], result["cpu"]
    columns = ["loop", "median wall (ms)", "min wall (ms)", "max wall (ms)", "wall ratio", "median CPU (ms)",
               "CPU ratio"]
    rows = [{"loop": name, "median wall (ms)": wall[f"{key}_median_s"] * 1e3,
             "min wall (ms)": wall[f"{key}_range_s"][0] * 1e3, "max wall (ms)": wall[f"{key}_range_s"][1] * 1e3,
             "wall ratio": wall["ratio"] if key == "ganscale" else 1.0,
             "median CPU (ms)": cpu[f"{key}_median_s"] * 1e3, "CPU ratio": cpu["ratio"] if key == "ganscale" else 1.0}
            for name, key in (("plain PyTorch", "plain"), ("ganscale Trainer", "ganscale"))]
    verdict = {clock: "met" if result[clock]["ratio"] <= 1.03 else "NOT met" for clock in ("wall", "cpu")}
    notes = [f"digits recipe DCGAN, batch {result['batch']}, fp32, 1 thread; {repeats} alternating blocks of "
             f"{steps} steps each after {warmup} warm-up steps each",
             *(f"{clock} ratio of medians {result[clock]['ratio']:.3f}, median of per-block ratios "
               f"{result[clock]['ratio_of_block_medians']:.3f} (blocks: "
               f"{', '.join(f'{r:.2f}' for r in result[clock]['block_ratios'])}); goal <= 1.03: {verdict[clock]}"
               for clock in ("wall", "cpu")),
             "CPU = this process's CPU time per step (all threads): on a shared machine it leaves out the waits "
             "for a core",
             "the trainer also computes both gradient norms, the skip/stop agreement (no collective in one process), "
             "seeded per-step latents, the step-time breakdown, the lr schedule, watchdog marks and a metrics line "
             "every log.every steps; "
             "samples, checkpoints and TensorBoard off"]
    if profile:
        click.echo(result.pop("profile"))
    publish(ctx, "overhead", columns, rows, notes, {"result": result})


@bench.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda when visible.")
@click.option("--batch", "batches", type=click.IntRange(min=1), multiple=True, help="Batch sizes (default 64 and 256).")
@click.option("--model", "models", type=click.Choice(["dcgan", "biggan", "stylegan2"]), multiple=True,
              help="Models (default dcgan and biggan).")
@click.option("--resolution", type=click.IntRange(min=8), default=None,
              help="Image side (default 64 on CUDA, 32 on CPU).")
@click.option("--dcgan-width", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--stylegan2-base", type=click.IntRange(min=1), default=None,
              help="StyleGAN2's channel_base (default 16384 on CUDA, as its 256 px config; 1024 on CPU).")
@click.option("--biggan-ch", type=click.IntRange(min=1), default=None,
              help="BigGAN ch (default 64 on CUDA, 16 on CPU).")
@click.option("--precision", type=click.Choice(["fp32", "bf16"]), default=None,
              help="Default: bf16 on CUDA, fp32 on CPU.")
@click.option("--iters", type=click.IntRange(min=1), default=5, show_default=True, help="Timed iterations.")
@click.option("--warmup", type=click.IntRange(min=1), default=2, show_default=True, help="Untimed iterations.")
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Peak for MFU (default on CUDA: the GPU's dense peak where ganscale knows it, e.g. H100 SXM "
                   "and H200: 989 bf16 / 67 fp32).")
@click.option("--engine", type=click.Choice(["torch", "tensorflow"]), default="torch", show_default=True,
              help="tensorflow: each DCGAN row also on the tensorflow engine's step, next to torch's (dcgan only).")
@THREADS
@OUT_DIR
@click.pass_context
def throughput(ctx: click.Context, device: str | None, batches: tuple[int, ...], models: tuple[str, ...],
               resolution: int | None, dcgan_width: int, stylegan2_base: int | None, biggan_ch: int | None,
               precision: str | None, iters: int, warmup: int, peak_tflops: float | None, engine: str, threads: int,
               out_dir: str) -> None:
    """Images/s, model FLOPs per iteration and MFU of DCGAN, BigGAN- and StyleGAN2-style training iterations."""
    import torch

    from ganscale.bench import throughput as bench_throughput

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    refuse_invisible_cuda(device)
    if engine == "tensorflow" and set(models) - {"dcgan"}:
        raise click.UsageError("--engine tensorflow: the tensorflow engine has only the dcgan of these models; "
                               "pass --model dcgan, or --engine torch")
    on_cuda = device == "cuda"
    models = models or (("dcgan",) if engine == "tensorflow" else ("dcgan", "biggan"))
    resolution = resolution or (64 if on_cuda else 32)
    _check_resolution(models, resolution)
    tensorflow_rows = _tensorflow_throughput(threads) if engine == "tensorflow" else None
    torch.set_num_threads(threads)
    ctx.params.update(device=device, batches=batches or (64, 256), models=models,
                      resolution=resolution, biggan_ch=biggan_ch or (64 if on_cuda else 16),
                      stylegan2_base=stylegan2_base or (16384 if on_cuda else 1024),
                      precision=precision or ("bf16" if on_cuda else "fp32"))
    p = ctx.params
    width = {"dcgan": dcgan_width, "biggan": p["biggan_ch"], "stylegan2": p["stylegan2_base"]}
    rows = [bench_throughput.measure(model, batch, p["resolution"], width[model], torch.device(device), p["precision"],
                                     iters, warmup, peak_tflops)
            for model in p["models"] for batch in p["batches"]]
    columns = ["model", "resolution", "width", "batch", "precision", "img_per_s", "iter_median_s", "gflop_per_iter",
               "achieved_tflops", "mfu"]
    if tensorflow_rows:  # each torch row, then the same model and batch on the tensorflow engine
        rows = [pair for row in rows
                for pair in ({"engine": "torch", **row}, tensorflow_rows(row, device, iters, warmup))]
        columns.insert(0, "engine")
    notes = ["one iteration = D step (G no-grad forward, D on [real, fake], Adam) + G step (G and frozen D, Adam); "
             "DCGAN nonsaturating loss, BigGAN hinge loss with 10 classes, StyleGAN2 nonsaturating loss (main phases: "
             "no R1 or path length; style mixing and noise on; width = channel_base)",
             "FLOPs from torch.utils.flop_counter.FlopCounterMode over one iteration (forward + backward)",
             f"MFU against {rows[0]['peak_tflops']} TFLOP/s" if rows[0]["peak_tflops"] else
             f"MFU: no peak known for {torch.cuda.get_device_name(device)}; pass --peak-tflops" if on_cuda else
             "MFU: no peak given on CPU",
             f"{threads} thread(s)" if not on_cuda else "CUDA: cudnn.allow_tf32 is torch's default (True)"]
    if tensorflow_rows:
        notes.append("tensorflow rows: the engine's own D and G steps (ganscale.tf.step, one replica, tf.function "
                     "graphs, the host's finite check) on the same DCGAN, batch and random reals; FLOPs as counted on "
                     "the torch row")
    publish(ctx, "throughput", columns, rows, notes)


def _check_resolution(models: tuple[str, ...], resolution: int) -> None:
    """Each model's own resolution rule, the one `ganscale train` applies to data.resolution; exit 2 naming
    --resolution."""
    from ganscale.config import ConfigError
    from ganscale.preflight import check_model_resolution

    for model in models:
        try:
            check_model_resolution(model, resolution)
        except ConfigError as e:
            refuse_at("--resolution", e)


def _tensorflow_throughput(threads: int):
    """A function (torch row, device, iters, warmup) -> the tensorflow engine's row of the same model and batch; exit 2
    without TensorFlow."""
    from ganscale.config import ConfigError
    from ganscale.tf.capabilities import require_tensorflow

    try:
        require_tensorflow()
    except ConfigError as e:
        refuse_at("--engine", e)
    from ganscale.tf import bench as tf_bench

    tf_bench.use_threads(threads)

    def row(torch_row: dict, device: str, iters: int, warmup: int) -> dict:
        measured = tf_bench.measure(torch_row["batch"], torch_row["resolution"], torch_row["width"], device,
                                    torch_row["precision"], iters, warmup)
        flops = torch_row["gflop_per_iter"] * 1e9 / measured["iter_median_s"] / 1e12
        peak = torch_row["peak_tflops"]
        return {**measured, "gflop_per_iter": torch_row["gflop_per_iter"], "achieved_tflops": flops,
                "peak_tflops": peak, "mfu": flops / peak if peak else None}

    return row


@bench.command()
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--model", type=click.Choice(sorted(MODELS)), default="dcgan", show_default=True,
              help="dcgan: the digits recipe; mlp: the ring8 recipe (R1 off, as zero2/fsdp D refuse it).")
@click.option("--steps", type=click.IntRange(min=5), default=30, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=None, help="Global batch (default: the recipe's).")
@click.option("--strategy", "strategies", type=click.Choice(["ddp", "zero1", "zero2", "fsdp", "G=fsdp,D=ddp"]),
              multiple=True, help="Rows to run (default all).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="train.device (default: the recipe's).")
@THREADS
@OUT_DIR
@click.pass_context
def strategies(ctx: click.Context, nproc: int, model: str, steps: int, batch: int | None, strategies: tuple[str, ...],
               device: str | None, threads: int, out_dir: str) -> None:
    """Each parallel strategy through `ganscale train --nproc N`: step time, bytes held, bytes communicated."""
    from ganscale.bench import strategies as bench_strategies

    ctx.params["strategies"] = strategies = strategies or tuple(bench_strategies.PAIRS)
    refuse_invisible_cuda(device)
    _check_strategy_runs(model, nproc, steps, batch, strategies, device)
    try:
        runs = bench_strategies.compare_strategies(model, nproc, steps, batch, list(strategies), threads, device)
    except bench_strategies.RunFailed as e:
        raise click.ClickException(str(e)) from None
    rows = [{"strategy": r["strategy"], "median step (ms)": r["step_median_s"] * 1e3, "p10 (ms)": r["step_p10_s"] * 1e3,
             "min (ms)": r["step_range_s"][0] * 1e3, "max (ms)": r["step_range_s"][1] * 1e3,
             "held MiB/rank": r["held_bytes_max_rank"] / 2**20,
             "optimizer MiB/rank": r["optimizer_bytes_max_rank"] / 2**20,
             "comm MiB/step": r["comm_bytes_per_step"] / 2**20,
             "comm by kind (MiB)": ", ".join(f"{k} {v / 2**20:.3f}" for k, v in r["comm_bytes_by_kind"].items()),
             "comm ops/step": r["comm_ops_per_step"]} for r in runs]
    columns = list(rows[0])
    notes = [f"model {model}, {nproc} processes, global batch {runs[0]['global_batch']}, {steps} steps, "
             f"{threads} thread(s) per process; median over steps {bench_strategies.SETUP_STEPS + 1}..{steps}",
             "every row logs a metrics line per step (log.every=1); samples, TensorBoard and periodic checkpoints off",
             "held = bytes of parameters + gradients + optimizer state of G and D on the rank holding most "
             "(summary.json held_bytes; activations and process memory not included)",
             "comm = payload bytes of every collective in one measured iteration (summary.json communicated_bytes)"]
    publish(ctx, "strategies", columns, rows, notes, {"runs": runs})


# The runs' config keys that are this command's options (an error at one of them names the option instead).
STRATEGY_OPTIONS = {"train.batch_size": "--batch", "train.device": "--device", "train.steps": "--steps"}


def _check_strategy_runs(model: str, nproc: int, steps: int, batch: int | None, strategies: tuple[str, ...],
                         device: str | None) -> None:
    """The preflight check each run's `ganscale train` makes, made here on the same config before any run starts:
    exit 2 with its one line (naming this command's option where the key is one)."""
    import torch

    from ganscale import config, preflight
    from ganscale.bench import strategies as bench_strategies
    from ganscale.config import ConfigError

    for name in strategies:
        recipe, overrides = bench_strategies.run_config(model, steps, batch, device, name)
        try:
            preflight.check(config.load(recipe, [*bench_strategies.QUIET, *overrides]), nproc, torch.cuda.is_available())
        except ConfigError as e:
            option = STRATEGY_OPTIONS.get(e.key)
            refuse_at(option or e.key, e, e.fix.replace(e.key, option) if option else None)


@bench.command()
@click.option("--nproc", type=click.IntRange(min=2), default=2, show_default=True)
@click.option("--model", type=click.Choice(sorted(MODELS)), default="dcgan", show_default=True)
@click.option("--per-rank-batch", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--steps", type=click.IntRange(min=5), default=60, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Pairs of runs (1 process, then N), alternating.")
@THREADS
@OUT_DIR
@click.pass_context
def scaling(ctx: click.Context, nproc: int, model: str, per_rank_batch: int, steps: int, repeats: int, threads: int,
            out_dir: str) -> None:
    """An N-process DDP step against a 1-process step of the same per-rank batch (goal: <= 1.2x on 2 cores)."""
    from ganscale.bench import scaling as bench_scaling

    recipe, base = MODELS[model]
    result = bench_scaling.ddp_scaling(recipe, base, nproc, per_rank_batch, steps, repeats, threads)
    rows = []
    ratios = {"one_process": (1.0, 1.0, 1.0), "n_process": (result["wall_ratio"], result["wall_p10_ratio"],
                                                            result["cpu_ratio"]),
              "independent": (result["independent_wall_ratio"], None, result["independent_cpu_ratio"])}
    for name, key, batch in (("1 process", "one_process", per_rank_batch),
                             (f"{nproc} processes, ddp", "n_process", per_rank_batch * nproc),
                             (f"{nproc} independent 1-process runs at once", "independent", per_rank_batch)):
        run, (wall_ratio, p10_ratio, cpu_ratio) = result[key], ratios[key]
        rows.append({"run": name, "global batch": batch, "median wall (ms)": run["wall_median_s"] * 1e3,
                     "p10 wall (ms)": run["wall_p10_s"] * 1e3, "median CPU (ms)": run["cpu_median_s"] * 1e3,
                     "wall ratio": wall_ratio, "p10 wall ratio": p10_ratio, "CPU ratio": cpu_ratio})
    verdict = "met" if result["wall_ratio"] <= 1.2 else "NOT met"
    notes = [f"model {model} ({recipe} recipe), per-rank batch {per_rank_batch}, {steps} steps per run (the first "
             f"{bench_scaling.SETUP_STEPS} not timed), {repeats} alternating pairs of runs, {threads} thread(s) per "
             "process; each rank runs the Trainer in a spawned process (gloo), per-step times from its progress hook",
             f"wall ratio of medians {result['wall_ratio']:.3f}; issue-6 target <= 1.2: {verdict}",
             f"per pair (each {nproc}-process run over the 1-process run just before it): median "
             f"{result['pair_wall_ratio_median']:.3f} of "
             + ", ".join(f"{r:.3f}" for r in result["pair_wall_ratios"]),
             "CPU = each rank's process CPU time per step (all threads): the work DDP adds; wall - CPU is time a rank "
             "is not running: waiting in a collective for its peer, or for a core on a shared machine",
             f"independent runs: the 1-process training {nproc} times at once, no communication: the machine's own "
             f"ceiling for {nproc} processes (shared caches, memory bandwidth, cores); ratio "
             f"{result['independent_wall_ratio']:.3f}. DDP's own cost is its ratio over this one"]
    publish(ctx, "scaling", list(rows[0]), rows, notes, {"result": result})


@bench.command("pix2pix-table")
@click.option("--data", type=click.Path(exists=True, file_okay=False), default=None,
              help="A folder of A|B pairs (facades layout). Default: a synthetic facades-shaped set of --images pairs.")
@click.option("--images", type=click.IntRange(min=1), default=None,
              help="Pairs in the synthetic set (default 400, as facades; 8 on the CPU). With --data: its size.")
@click.option("--epochs", type=click.IntRange(min=2), default=3, show_default=True,
              help="Epochs per row: the first is reported on its own (one-time work), the rest give median and spread.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda when visible.")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Processes of the data-parallel and ZeRO rows (default: every visible GPU, or 2 on the CPU).")
@click.option("--rows", "rows_csv", default=None,
              help="Comma-separated rows to run (default all): baseline, ddp, amp-bf16, amp-fp16, accumulation-4, "
                   "clip-2, zero1, zero2, fsdp, fsdp-offload, fast.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads per run, shared by its processes on the CPU; on CUDA each process gets them all "
                   "(default: all usable cores).")
@OUT_DIR
@click.pass_context
def pix2pix_table(ctx: click.Context, data: str | None, images: int | None, epochs: int, device: str | None,
                  nproc: int | None, rows_csv: str | None, threads: int | None,
                  out_dir: str) -> None:
    """A published pix2pix speed table (facades, 256x256, batch 1: eager, AMP, accumulation, clipping, ZeRO),
    every row on this machine, and ganscale's fast path beside it."""
    import os

    import torch

    from ganscale.bench import pix2pix

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    refuse_invisible_cuda(device)
    names = [n.strip() for n in rows_csv.split(",")] if rows_csv is not None else pix2pix.ROW_NAMES
    if "" in names:  # --rows "" or "baseline,": not "every row"
        raise click.BadParameter(f"{rows_csv!r} names an empty row; give comma-separated rows, e.g. --rows "
                                 "baseline,fast, or leave --rows out for all", param_hint="--rows")
    unknown = sorted(set(names) - set(pix2pix.ROW_NAMES))
    if unknown:
        raise click.BadParameter(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(pix2pix.ROW_NAMES)}",
                                 param_hint="--rows")
    if data is not None:
        from ganscale.config import ConfigError
        from ganscale.data.paired import PairedImages

        try:
            images = len(PairedImages(data))
        except ConfigError as e:  # the option here is --data (the rows pass it on as data.path)
            refuse_at("--data", e, e.fix.replace("data.path", "--data"))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ctx.params.update(device=device, images=images or (400 if device == "cuda" else 8),
                      nproc=nproc or (torch.cuda.device_count() if device == "cuda" else 2),
                      threads=threads or usable, rows_csv=",".join(names))
    p = ctx.params
    results = pix2pix.table(Path(data) if data else None, p["images"], epochs, p["nproc"], device, p["threads"], names)
    baseline = next((r for r in results if r["row"] == "baseline" and r["status"] == "ok"), None)
    notes = [f"pix2pix (U-Net 256 + 70x70 PatchGAN, BCE + 100 L1, Adam 2e-4), {p['images']} images of 256x256 per "
             f"epoch ({'--data ' + data if data else 'synthetic facades-shaped set'}), {epochs} epochs per row, "
             f"device {device}; each row is one `ganscale train pix2pix` run",
             "first epoch: start-up, autotuning and compilation included; median/min/max over the later epochs",
             "peak MiB: CUDA max_memory_allocated of rank 0 on a GPU, else rank 0's peak host RSS",
             "data wait %: the trainer's time_data_ms share of its step-time breakdown (log.step_times, later epochs)",
             "document s/epoch: the seed document's numbers for its one GPU, 400 images (see "
             "../shared/notes/reference-numbers.md: its 'data parallel' row ran one process; its ZeRO is one row)"]
    fast = next((r for r in results if r["row"] == "fast" and r["status"] == "ok"), None)
    if baseline and fast:
        speedup = baseline["epoch median s"] / fast["epoch median s"]
        notes.append(f"fast path vs ganscale's eager fp32 baseline in this run: {speedup:.2f}x (GPU target >= 3x)")
        if device == "cuda":
            epoch_400 = fast["epoch median s"] * 400 / p["images"]
            notes.append(f"fast path, a 400-image epoch: {epoch_400:.2f} s "
                         "(target <= 4 s, the document's 40.38 s / 10)")
    publish(ctx, "pix2pix-table", pix2pix.COLUMNS, results, notes, {"rows_detail": results})
    failed = [r["row"] for r in results if r["status"].startswith("failed")]
    if failed:  # the table is written; the command still says that it is incomplete
        click.echo(f"ganscale: {len(failed)} of {len(results)} row(s) failed ({', '.join(failed)}): each one's output "
                   "is shown above where it failed, and kept in the JSON record ('output')", err=True)
        sys.exit(1)
