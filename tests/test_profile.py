"""log.profile_steps: a few steps profiled with torch.profiler, on every rank, changing nothing they train."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from dist_helpers import train_in_process
from ganscale import config, preflight
from ganscale.config import ConfigError
from ganscale.observe import profile as step_profile
from ganscale.observe.profile import compile_line, report

TINY = ["model.z_dim=8", "model.g_width=8", "model.d_width=8", "train.batch_size=8", "train.steps=4",
        "log.every=1", "log.sample_every=0", "checkpoint.every=0", "log.tensorboard=false"]


def test_the_profiled_steps_are_written_and_train_as_unprofiled_ones(tmp_path):
    torch.compile(torch.nn.Linear(2, 2))(torch.ones(1, 2))  # another compilation in this process: not the run's
    plain = train_in_process(config.load(None, TINY), tmp_path / "plain")
    profiled = train_in_process(config.load(None, [*TINY, "log.profile_steps=2", "log.profile_after=1"]),
                                tmp_path / "profiled")
    text = (tmp_path / "profiled" / "profile" / "rank0.txt").read_text()
    assert text.startswith("steps 2-3 as logged (2),")
    assert "aten::convolution" in text or "aten::conv" in text
    assert not (tmp_path / "plain" / "profile").exists()
    assert "torch.compile" not in text  # nothing compiled: no line on it
    for a, b in zip(plain.G.module.state_dict().values(), profiled.G.module.state_dict().values()):
        assert torch.equal(a, b)


def test_a_compiled_run_is_told_its_graphs_and_the_recompiles_inside_the_window(tmp_path):
    from torch._dynamo.utils import counters

    torch.compile(torch.nn.Linear(2, 2))(torch.ones(1, 2))  # compiled before the run: not the run's
    before = counters["stats"]["unique_graphs"]
    train_in_process(config.load(None, [*TINY, "train.compile=default", "log.profile_steps=2", "log.profile_after=2"]),
                     tmp_path)
    line = next(line for line in (tmp_path / "profile" / "rank0.txt").read_text().splitlines()
                if line.startswith("torch.compile"))
    graphs = counters["stats"]["unique_graphs"] - before
    assert before >= 1 and graphs >= 2  # G and D at least
    calls = int(line.rsplit(", ", 1)[1].split()[0])
    assert calls >= 4  # G's and D's graphs in each of the two steps: the networks did not run eagerly
    assert line == (f"torch.compile in this run: {graphs} graphs, 0 graph breaks, 0 CUDA graphs skipped "
                    "(TORCH_LOGS=perf_hints says why); in the profiled steps: 0 graphs compiled (recompiles: "
                    f"TORCH_LOGS=recompiles says why), {calls} calls of compiled code")


def test_graphs_compiled_inside_the_window_are_counted_as_recompiles():
    line = compile_line({"graphs": 9, "graph breaks": 1, "CUDA graphs skipped": 2},
                        {"graphs": 3, "graph breaks": 0, "CUDA graphs skipped": 0})
    assert "9 graphs, 1 graph breaks, 2 CUDA graphs skipped" in line and "profiled steps: 3 graphs compiled" in line
    assert compile_line({"graphs": 0, "graph breaks": 0, "CUDA graphs skipped": 0}, {"graphs": 0}) is None


def test_cuda_graph_trees_recorded_graphs_and_calls_outside_them_are_read_from_their_counters(monkeypatch):
    """The trees number recorded graphs 0, 1, ... and warm-up runs -1, -2, ...: 3 graphs and 7 calls outside."""
    import itertools

    from torch._inductor import cudagraph_trees

    recorded, warmups = itertools.count(0), itertools.count(start=-1, step=-1)
    for _ in range(3):
        next(recorded)
    for _ in range(7):
        next(warmups)
    manager = SimpleNamespace(graph_counter=recorded, warmup_node_counter=warmups)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda device, create_if_none_exists: manager)
    counts = {"CUDA graphs recorded": 3, "calls outside CUDA graphs": 7}
    assert step_profile.cuda_graph_tree_counts() == counts
    assert step_profile.cuda_graph_tree_counts() == counts  # read from the counters, not taken from them
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda device, create_if_none_exists: None)  # no trees yet
    assert step_profile.cuda_graph_tree_counts() == {"CUDA graphs recorded": 0, "calls outside CUDA graphs": 0}


def test_a_run_with_cuda_graph_trees_is_told_what_they_recorded_and_ran_outside_a_graph():
    run = {"graphs": 3, "graph breaks": 0, "CUDA graphs skipped": 0, "CUDA graphs recorded": 6,
           "calls outside CUDA graphs": 90}
    window = {"graphs": 0, "graph breaks": 0, "CUDA graphs skipped": 0, "CUDA graphs recorded": 0,
              "calls outside CUDA graphs": 60}
    line = compile_line(run, window)
    assert line.endswith("; CUDA-graph trees: 6 graphs recorded and 90 compiled calls run outside a graph in this "
                         "run, 0 and 60 in the profiled steps (a steady step replays: both 0)")
    quiet = {**run, "CUDA graphs recorded": 0, "calls outside CUDA graphs": 0}
    assert "CUDA-graph trees" not in compile_line(quiet, window)


def test_a_window_inside_a_run_that_ends_first_is_written_as_far_as_it_went(tmp_path):
    train_in_process(config.load(None, [*TINY, "log.profile_steps=10", "log.profile_after=2"]), tmp_path)
    assert (tmp_path / "profile" / "rank0.txt").read_text().startswith("steps 3-4 as logged (2),")


def test_a_window_past_the_last_step_is_refused_by_name():
    cfg = config.load(None, [*TINY, "log.profile_steps=2", "log.profile_after=4"])
    with pytest.raises(ConfigError, match="log.profile_after.*below 4"):
        preflight.check(cfg, 1, False)


def event(key, count, device_us=0.0, cpu_us=0.0, device=DeviceType.CPU):
    return SimpleNamespace(key=key, count=count, self_device_time_total=device_us, self_cpu_time_total=cpu_us,
                           device_type=device)


def test_the_cuda_summary_gives_busy_share_launches_and_synchronisations():
    """Two steps of 10 ms wall: 4 ms of kernels a step, 30 launches (10 of them graph replays), 2 syncs."""
    events = [event("cudaLaunchKernel", 40, cpu_us=400), event("cudaGraphLaunch", 20, cpu_us=200),
              event("cudaStreamSynchronize", 4, cpu_us=9000),
              event("void conv_kernel", 30, device_us=6000, device=DeviceType.CUDA),
              event("Memcpy DtoH (Device -> Pinned)", 4, device_us=2000, device=DeviceType.CUDA)]
    text = report(events, 10, 12, 0.020, cuda=True)
    assert text.splitlines()[0] == "steps 11-12 as logged (2), 10.00 ms a step (wall, profiler on)"
    assert "CUDA kernels 4.00 ms a step: the GPU busy 40% of the wall time" in text
    assert "launches a step: 30 (of them CUDA graph replays: 10); host synchronisations a step: 2.0, " \
           "device-to-host copies 2.0" in text
    device_table = text.split("Device: kernels by their time")[1]
    assert device_table.index("void conv_kernel") < device_table.index("Memcpy DtoH")
