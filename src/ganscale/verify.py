"""`ganscale verify`: the test suite's proof, for a user's own config. It trains a few steps on N processes and on
one process with the same global batch, compares the two trainings, and gives one verdict: EQUAL, or DIFFERENT
with the first step at which they part, the first tensor that differs and the probable cause.

What is compared is what rounding cannot move and a real difference does: every optimizer step's losses and
gradients before the optimizer (per-tensor L2 norms and sums, from log.fingerprints), G's samples in each D step
(the first place a difference in G shows: D's gradients differ only because of them), the floating buffers after
every step, and what G, G_ema and D compute on fixed inputs after the last step. Not the parameters one by one: a
parameter whose gradient is pure rounding noise (a bias feeding a normalisation) moves by about one Adam step
either way on any hardware, while the function the network computes does not change.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ganscale import checkpoint, preflight
from ganscale import config as config_mod
from ganscale.config import Config, ConfigError
from ganscale.fault import EXIT_CONFIG, run_training_process
from ganscale.observe import fingerprints
from ganscale.preflight import StartWarning, cross_rank_batchnorm



@dataclass(frozen=True)
class Tolerance:
    """Largest relative difference that counts as rounding: of each step's losses, of its gradients, and of the
    state after a step (buffers, and network outputs after the last)."""

    loss: float
    gradient: float
    state: float


# fp32: the README's measured criterion. bf16 rounds to 8 significant bits: `ganscale verify digits --set
# train.precision=bf16` on 2 CPU processes measures up to 1e-5 in the losses, 5e-2 in the gradients and 5e-3 in
# buffers and outputs (with parallel.sync_bn=false too: 3e-1 in the gradients, 1e0 in the buffers). fp16's 11 bits
# round less than bf16's, and get its bounds.
TOLERANCES = {"fp32": Tolerance(1e-5, 1e-5, 1e-4), "bf16": Tolerance(1e-4, 1e-1, 2e-2),
              "fp16": Tolerance(1e-4, 1e-1, 2e-2)}
FIXED_INPUTS = 64  # samples G, G_ema and D are run on after the last step
RESULTS = {"one": "one", "many": "n{}"}  # run folders under the verify folder
KINDS = {"fakes": "G's samples in D's steps", "loss": "losses", "gradient": "gradients", "buffer": "buffers",
         "output": "outputs"}  # in reporting order


@dataclass(frozen=True)
class Difference:
    """One compared quantity: where (step, phase, tensor) and how far apart, relative, against its tolerance."""

    step: int
    phase: str  # "D" / "G" (that network's update), "after" (the state after the step), "outputs"
    kind: str  # one of KINDS
    what: str
    relative: float
    tolerance: float

    @property
    def exceeds(self) -> bool:
        return not self.relative <= self.tolerance  # NaN exceeds

    def where(self) -> str:
        phase = {"D": "D's update", "G": "G's update", "after": "after the step"}.get(self.phase)
        return f"after step {self.step}, on fixed inputs" if phase is None else f"step {self.step}, {phase}"


def relative(a: float, b: float, scale: float) -> float:
    """|a - b| against `scale`; non-finite values (fingerprints keep no sign or kind of them) are equal to each
    other and infinitely far from any finite value."""
    if math.isfinite(a) != math.isfinite(b):
        return math.inf
    return 0.0 if not math.isfinite(a) else abs(a - b) / max(scale, 1e-12)


def compare_steps(one: list[dict], many: list[dict], tolerance: Tolerance) -> list[Difference]:
    """Every quantity of the per-step fingerprints, in training order: each optimizer step's inputs from G (a D
    step's samples, norm and sum relative to their norm), losses (relative to the loss) and gradients (norm and sum
    per tensor, relative to the network's largest gradient norm), then the floating buffers after the step
    (relative to the buffer's norm)."""
    found = []
    for a, b in zip(one, many, strict=True):
        step, phase = a["step"], a["net"]
        if phase == "after":
            for name, (norm, total) in a["buffers"].items():
                other = b["buffers"][name]
                found.append(Difference(step, phase, "buffer", name, max(relative(norm, other[0], norm),
                                                                         relative(total, other[1], norm)),
                                        tolerance.state))
            continue
        if "fakes" in a and "fakes" in b:
            (norm, total), other = a["fakes"], b["fakes"]
            found.append(Difference(step, phase, "fakes", "G's output (the samples D judges)",
                                    max(relative(norm, other[0], norm), relative(total, other[1], norm)),
                                    tolerance.state))
        for term, (x, y) in zip(("loss_d", "penalty_d") if phase == "D" else ("loss_g", "l1_g"),
                                zip(a["losses"], b["losses"])):
            found.append(Difference(step, phase, "loss", f"{phase}'s {term}", relative(x, y, max(abs(x), abs(y))),
                                    tolerance.loss))
        scale = max((norm for norm, _ in a["grads"].values() if math.isfinite(norm)), default=0.0)
        for name, (norm, total) in a["grads"].items():
            other = b["grads"][name]
            found.append(Difference(step, phase, "gradient", f"{phase}.{name} (gradient)",
                                    max(relative(norm, other[0], scale), relative(total, other[1], scale)),
                                    tolerance.gradient))
    return found


# ----------------------------------------------------------------------------------- fixed inputs
def fixed_batch(cfg: Config, n: int, dataset=None) -> tuple[Tensor, ...]:
    """The first global batch of `n` samples of the data set, as one process takes it (the trainer's own stream)."""
    from ganscale.data import GlobalBatches, Slicing, build_dataset

    dataset = dataset if dataset is not None else build_dataset(cfg)
    stream = GlobalBatches(dataset, Slicing(0, 1, n, 1), cfg.train.seed, torch.device("cpu"))
    return next(stream)[0]


def network_outputs(cfg: Config, states: dict[str, dict], real: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """What G and G_ema compute on fixed latents in training mode (batch statistics) and G_ema in eval mode (its
    running statistics), and what D computes in eval mode on real samples and on uniform noise of their shape."""
    from ganscale.models import build_networks
    from ganscale.tasks import build_task

    task = build_task(cfg, previews=False)
    generator, discriminator = build_networks(cfg)
    inputs = torch.Generator().manual_seed(1)
    n = len(real[0])
    z = torch.randn(n, cfg.model.z_dim, generator=inputs)
    labels = task.labels(n, inputs) if task.n_classes else None
    seen = task.critic_view(real, task.real_images(real))
    judged = torch.cat([seen, torch.rand(seen.shape, generator=inputs) * 2 - 1])
    real_labels = task.real_labels(real)
    conditions = task.critic_conditions(None, None if real_labels is None else torch.cat([real_labels] * 2))
    out = {}
    with torch.no_grad():
        for name, net, train in (("G", "G", True), ("G_ema", "G_ema", True), ("G_ema (eval)", "G_ema", False)):
            generator.load_state_dict(states[net])
            out[f"{name} output"] = task.generate(generator.train(train), real, z, labels)
        discriminator.load_state_dict(states["D"])
        out["D output (eval)"] = discriminator.eval()(judged, *conditions)
    return out


def compare_outputs(cfg: Config, one: Path, many: Path, step: int, tolerance: float) -> list[Difference]:
    """The networks of both runs' final checkpoints on the same fixed inputs, each output relative to its largest
    value in the one-process run."""
    states = [checkpoint.load(checkpoint.newest_intact(run, "--run-dir", "train again")) for run in (one, many)]
    n = FIXED_INPUTS - FIXED_INPUTS % cfg.model.pack  # a packed D judges whole packs
    real = fixed_batch(cfg, n)
    expected, got = (network_outputs(cfg, state, real) for state in states)
    return [Difference(step, "outputs", "output", name, float((expected[name] - got[name]).abs().max()
                                                     / expected[name].abs().max().clamp_min(1e-12)), tolerance)
            for name in expected]


# ----------------------------------------------------------------------------------- causes
@dataclass
class Evidence:
    """What the causes are recognised from: the config, the world size, both runs' fingerprints (N processes', one
    process's) and the step at which the runs part (None: any)."""

    cfg: Config
    nproc: int
    many: list[dict]
    one: list[dict] = field(default_factory=list)
    parted_at: int | None = None
    warnings: list[StartWarning] = field(default_factory=list)  # preflight.check's, for the N-process run

    @cached_property
    def drawing(self) -> dict[str, str]:
        """{key: where} of the user's code preflight found drawing from the per-rank random generators:
        model.generator, model.discriminator, data.dataset; where: "aten.randn_like at nets.py:24 in forward", or ""
        where preflight could not name the op (numpy's draws)."""
        return {w.key: w.where for w in self.warnings if w.key is not None and not w.own_generator}

    @cached_property
    def own_generators(self) -> dict[str, str]:
        """{key: where} of the networks preflight found drawing from a torch.Generator of their own."""
        return {w.key: w.where for w in self.warnings if w.key is not None and w.own_generator}

    def _before_parting(self, record: dict) -> bool:
        """An optimizer step's record, up to the step the runs part."""
        return record["net"] != "after" and (self.parted_at is None or record["step"] <= self.parted_at)

    @cached_property
    def rounding_noise(self) -> tuple[str, int, int, float | None, float | None] | None:
        """(tensor, step, element, one process's value, N processes') of the first gradient element, up to the step
        the runs part, that is rounding noise (fingerprints.ROUNDING_NOISE) in one run at least and not the same in
        both. A value is None where that run recorded none for the element although it would have, had it been
        rounding noise there: exactly 0 (terms that cancel exactly), or not near zero."""
        for a, b in zip(self.one, self.many):
            if not self._before_parting(a):
                continue
            mine, theirs = _noise_elements(a), _noise_elements(b)
            for name, i in sorted(mine.keys() | theirs.keys(), key=lambda key: (_order(a, key[0]), key[1])):
                x, y = mine.get((name, i)), theirs.get((name, i))
                if (x is None and not _would_record(a, name, i)) or (y is None and not _would_record(b, name, i)):
                    continue  # past what that run recorded of the tensor: its value there is unknown
                if x is None or y is None or abs(x - y) > max(abs(x), abs(y)) / 10:
                    return f"{a['net']}.{name}", a["step"], i, x, y
        return None

    @cached_property
    def dead_bias(self) -> tuple[str, int, float, float] | None:
        """(tensor, step, its gradient's norm, the network's largest) of the first bias, up to the step the runs part,
        whose whole gradient is rounding noise on one process: a normalisation after it subtracts it."""
        for record in filter(self._before_parting, self.one):
            norms = {name: norm for name, (norm, _) in record["grads"].items() if math.isfinite(norm)}
            largest = max(norms.values(), default=0.0)
            for name, norm in norms.items():
                if name.endswith("bias") and 0 < norm <= fingerprints.ROUNDING_NOISE * largest:
                    return f"{record['net']}.{name}", record["step"], norm, largest
        return None

    @cached_property
    def batchnorm(self) -> str | None:
        """The trainer's own warning for BatchNorm that does not normalise as one process does, or None."""
        from ganscale.models import meta_networks
        from ganscale.trainer import per_rank_batchnorm

        return per_rank_batchnorm(self.cfg, self.nproc, *meta_networks(self.cfg))

    @cached_property
    def rng_steps(self) -> list[int]:
        """Steps (1..K, as the log and the first divergence count them) in which rank 0 of the N-process run drew
        from its own RNG stream. Step 1 counts: the data stream never draws from it (its DataLoader seeds its workers
        from a generator of its own), so without a network's randomness step 1's draws are none."""
        return sorted({r["step"] for r in self.many if r.get("rng_drawn")})

    @cached_property
    def data_differs(self) -> bool:
        """Whether the data set, built again as another rank with other RNG states would build it, holds other
        samples (its first global batch, and its size)."""
        from ganscale.data import build_dataset

        first = build_dataset(self.cfg)
        with _as_another_process():
            second = build_dataset(self.cfg)
        if len(first) != len(second):
            return True
        n = min(FIXED_INPUTS, len(first))
        return any(not torch.equal(a, b) for a, b in zip(fixed_batch(self.cfg, n, first),
                                                          fixed_batch(self.cfg, n, second)))

    def precision_or_strategy(self) -> str | None:
        """What rounds differently from one DDP process in fp32, named; None when nothing does."""
        t, p = self.cfg.train, self.cfg.parallel
        named = [f"train.precision={t.precision}"] if t.precision != "fp32" else []
        named += [f"parallel.{net}={s}" for net, s in (("generator", p.generator), ("discriminator", p.discriminator))
                  if s != "ddp"]
        named += [f"train.compile={t.compile}"] if t.compile != "off" else []
        return ", ".join(named) or None


def _noise_elements(record: dict) -> dict[tuple[str, int], float]:
    return {(name, int(i)): v for name, elements in record.get("rounding_noise", {}).items() for i, v in elements}


def _would_record(record: dict, name: str, element: int) -> bool:
    """Whether `record` would hold `element` of `name` had it been rounding noise: a tensor's first NOISE_ELEMENTS
    such elements by index are kept."""
    kept = record.get("rounding_noise", {}).get(name, [])
    return len(kept) < fingerprints.NOISE_ELEMENTS or element < int(kept[-1][0])


def _order(record: dict, name: str) -> int:
    """The tensor's place among the record's gradients (its network's parameter order)."""
    names = list(record.get("grads", {}))
    return names.index(name) if name in names else len(names)


@contextlib.contextmanager
def _as_another_process() -> Iterator[None]:
    """Rank 1's environment and RNG states other than this process's, restored on leaving."""
    saved = (os.environ.get("RANK"), torch.get_rng_state(), np.random.get_state(), random.getstate())
    os.environ["RANK"] = "1"
    torch.manual_seed(1_000_003)
    np.random.seed(1_000_003)
    random.seed(1_000_003)
    try:
        yield
    finally:
        rank, torch_state, numpy_state, python_state = saved
        if rank is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = rank
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def _network_draws(e: Evidence) -> str:
    """The randomness cause's problem: the networks preflight found drawing, with their op and place, or "a
    network" where it found none (a draw its two batches did not reach, an injected fault)."""
    named = {key: where for key, where in e.drawing.items() if key.startswith("model.")}
    subject = " and ".join(f"{key}'s forward" for key in named) or "a network"
    where = "; ".join(where or "a random op" for where in named.values()) or (
        "torch.randn, dropout or another random op in forward")
    return (f"{subject} drew from its rank's own RNG stream in step {e.rng_steps[0]} ({where}): each rank draws other "
            "numbers than one process does")


def _data_set_draws(e: Evidence) -> tuple[str, str]:
    """The data-set cause: (problem, fix), naming data.dataset's draw where preflight found it. A custom data set is
    given data.dataset_args, not train.seed: its seed goes there (as train's warning says)."""
    problem = "built as another rank with other RNG states would build it, the data set holds other samples"
    if "data.dataset" in e.drawing:
        where = e.drawing["data.dataset"]
        problem += f": data.dataset draws from the process's random generators{f' ({where})' if where else ''}"
    seeded = ("data.dataset_args (numpy.random.default_rng(seed), torch.Generator().manual_seed(seed))"
              if e.cfg.data.kind == "custom" else "train.seed")
    return problem, (f"make the data set a function of its config alone: draw its randomness from a generator seeded "
                     f"from {seeded}, never from the process's RNG, its rank or the clock")


def _split_fix(warning: str, fallback: str) -> tuple[str, str]:
    problem, _, fix = warning.partition(" Fix: ")
    return problem.rstrip("."), fix or fallback


@dataclass(frozen=True)
class Cause:
    """One entry of the catalogue: how it is recognised, and what is said of it: (problem, fix)."""

    name: str
    recognised: Callable[[Evidence], bool]
    explain: Callable[[Evidence], tuple[str, str]]


# In order: the first recognised cause is named. Certain causes (read from the config) before inferred ones.
CAUSES = (
    Cause("BatchNorm statistics per rank",
          lambda e: e.batchnorm is not None and not cross_rank_batchnorm(e.cfg, e.nproc),
          lambda e: _split_fix(e.batchnorm, "leave train.micro_batch unset, so that cross-rank BatchNorm normalises "
                                            "what one process does")),
    Cause("cross-rank BatchNorm over another number of samples than one process",
          lambda e: e.batchnorm is not None and cross_rank_batchnorm(e.cfg, e.nproc),
          lambda e: _split_fix(e.batchnorm, "leave train.micro_batch unset")),
    Cause("a data set whose items differ between processes",
          lambda e: e.data_differs,
          _data_set_draws),
    Cause("randomness drawn from the per-rank RNG inside a network",
          lambda e: bool(e.rng_steps),
          lambda e: (_network_draws(e),
                     "derive per-sample randomness from the sample's global position, e.g. from its latent (as "
                     "pix2pix's dropout does: ganscale.randomness's normal, uniform and dropout), or remove it")),
    Cause("randomness drawn from a torch.Generator a network holds",
          lambda e: bool(e.own_generators),
          lambda e: ("; ".join(f"{key}'s forward draws from a torch.Generator of its own" + (f" ({where})" if where
                                                                                             else "")
                               for key, where in e.own_generators.items()) + ": every rank draws the same numbers for "
                     "its share of the batch, where one process draws other numbers for each sample",
                     "draw per-sample randomness from the sample's global position (ganscale.randomness's normal, "
                     "uniform and dropout), or remove it")),
    Cause("a bias whose gradient is rounding noise, which Adam scales up",
          lambda e: e.rounding_noise is not None and e.dead_bias is not None,
          lambda e: ("{0}'s gradient in step {1} is zero up to rounding (norm {2:.1e}, the network's largest {3:.1e}): "
                     "a normalisation after it subtracts it, so the two runs round it apart, and Adam divides a "
                     "gradient by its running size, so the bias moves by up to its learning rate either way and the "
                     "running statistics follow it".format(*e.dead_bias),
                     "build that layer with bias=False (the normalisation's own shift replaces it)")),
    Cause("gradient elements that are rounding noise, which Adam scales up",
          lambda e: e.rounding_noise is not None,
          lambda e: ("element {2} of {0}'s gradient in step {1} is {3} on one process and {4} on N: near zero, "
                     "so rounding sets it (a rarely active unit, terms that cancel), and Adam divides a gradient by its "
                     "running size, so that parameter moves by up to its learning rate either way; the runs part from "
                     "there".format(*e.rounding_noise[:3], *map(_noise_value, e.rounding_noise[3:])),
                     "none in the config: no bias feeds a normalisation, and the two runs are the same training up to "
                     "fp32 rounding, which Adam carries into the weights; the steps before the runs part are compared "
                     "within the tolerance")),
    Cause("a strategy or precision whose tolerance was exceeded",
          lambda e: e.precision_or_strategy() is not None,
          lambda e: (f"{e.precision_or_strategy()} sums in another order than one process in fp32 does, and the "
                     "difference exceeded the tolerance",
                     "verify with --set train.precision=fp32 and ddp for both networks: EQUAL there means the "
                     "difference is this setting's rounding")),
    Cause("no known cause",
          lambda e: True,
          lambda e: ("none of the catalogue's causes was recognised",
                     "look at the tensor named above for state that differs by rank: a buffer updated per rank, "
                     "a branch on the rank, data read per process")),
)


def _noise_value(value: float | None) -> str:
    return "0 or not near zero" if value is None else f"{value:.1e}"


def probable_cause(evidence: Evidence) -> tuple[str, str, str]:
    """(cause, problem, fix) of the first catalogue entry the evidence fits."""
    cause = next(c for c in CAUSES if c.recognised(evidence))
    return (cause.name, *cause.explain(evidence))


# ----------------------------------------------------------------------------------- the command
def plan(recipe: str | None, overrides: tuple[str, ...], nproc: int,
         steps: int) -> tuple[Config, list[str], list[str]]:
    """(config as both runs train it, the --set overrides that make it, preflight's warnings for the N-process run):
    refused with a ConfigError where the two runs cannot be compared."""
    if nproc < 2:
        raise ConfigError("--nproc", f"{nproc} process: verify compares N processes with one",
                          "pass --nproc 2 or more")
    if steps < 2:
        raise ConfigError("--steps", f"{steps}: a network's randomness shows from the second step on",
                          "pass --steps 2 or more (default 4)")
    forced = [f"train.steps={steps}", "checkpoint.every=0", "log.sample_every=0", f"log.every={steps}",
              "log.tensorboard=false", "eval.every=0", "log.fingerprints=true",
              "train.tf32=false"]  # on a GPU, TF32 convolutions round by the batch's shape, which N processes change
    sets = [*overrides, *forced]  # after the user's: these are what verify needs
    cfg = config_mod.load(recipe, sets)
    if cfg.train.engine != "torch":  # verify reads the torch engine's fingerprints of every step
        raise ConfigError("train.engine", f"verify compares the torch engine's runs, not the {cfg.train.engine} "
                          "engine's", "verify with train.engine=torch (its replicas are proven equal to one process "
                          "by tests/test_tf_engine.py)")
    cuda = torch.cuda.is_available()
    warnings = []
    for world in (nproc, 1):
        try:
            said = preflight.check(cfg, world, cuda)
        except ConfigError as e:
            raise ConfigError(e.key, f"{e.problem} (the {world}-process run)", e.fix) from None
        warnings = said if world == nproc else warnings
    return cfg, sets, warnings


def verify_folder(run_dir: str | None) -> contextlib.AbstractContextManager[Path]:
    """RUN_DIR (new or empty: nothing there is overwritten), or a temporary folder removed afterwards."""
    if run_dir is None:
        return tempfile.TemporaryDirectory(prefix="ganscale-verify-")
    path = Path(run_dir)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError("--run-dir", f"'{run_dir}' already exists and is not an empty folder",
                          "choose a new or empty --run-dir (or leave it out: a temporary folder)")
    return contextlib.nullcontext(path)


class TrainingFailed(Exception):
    """One of the two trainings exited with an error; its exit code and the end of its output."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.exit_code = code


def train(recipe: str | None, sets: list[str], nproc: int, run_dir: Path, exit_timeout_s: float) -> None:
    """`ganscale train` with `--nproc nproc` into `run_dir`, its output into run_dir.log; TrainingFailed on an
    error (a config error keeps exit 2 and its own line). Interrupted, it stops the training first
    (fault.run_training_process)."""
    command = [sys.executable, "-m", "ganscale", "train", *([recipe] if recipe else []),
               *sum((["--set", s] for s in sets), []), "--nproc", str(nproc), "--run-dir", str(run_dir)]
    log = run_dir.with_name(run_dir.name + ".log")
    with open(log, "w") as out:
        code = run_training_process(command, exit_timeout_s, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL).returncode
    if code:
        lines = log.read_text(errors="replace").splitlines()
        said = [line for line in lines if line.startswith("ganscale: ")]
        if code == EXIT_CONFIG and said:
            raise TrainingFailed(said[-1][len("ganscale: "):], code)
        tail = "\n".join(lines[-15:])
        raise TrainingFailed(f"the {nproc}-process training failed with exit code {code}; its output ends:\n{tail}",
                             code)


def run(recipe: str | None, overrides: tuple[str, ...], nproc: int, steps: int, run_dir: str | None,
        say: Callable[[str], None]) -> int:
    """The command: exit code 0 (EQUAL) or 1 (DIFFERENT). ConfigError (exit 2) before anything is written."""
    from ganscale import launch

    if launch.under_launcher():
        raise ConfigError("verify", "it starts its own processes, and runs here under a launcher (torchrun)",
                          "run `ganscale verify --nproc N` directly")
    cfg, sets, warnings = plan(recipe, overrides, nproc, steps)
    tolerance = TOLERANCES[cfg.train.precision]
    with verify_folder(run_dir) as folder:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        one, many = folder / RESULTS["one"], folder / RESULTS["many"].format(nproc)
        say(f"training {steps} steps of '{cfg.name}' on 1 process and on {nproc} (global batch "
            f"{cfg.train.batch_size}, {cfg.train.precision}) in {folder}")
        for world, where in ((1, one), (nproc, many)):
            train(recipe, sets, world, where, cfg.fault.exit_timeout_s)
        records = [fingerprints.read(one), fingerprints.read(many)]
        differences = compare_steps(*records, tolerance)
        differences += compare_outputs(cfg, one, many, steps, tolerance.state)
        parted = next((d for d in differences if d.exceeds), None)
        evidence = Evidence(cfg, nproc, records[1], records[0], parted.step if parted else None, warnings)
        verdict = report(differences, evidence, cfg, nproc, tolerance)
        for line in verdict:
            say(line)
        return 1 if any(d.exceeds for d in differences) else 0


CRITERION = ("every optimizer step's losses within {t.loss:.0e} and gradients (before the optimizer) within "
             "{t.gradient:.0e}, G's samples in every D step, buffers after every step and what G, G_ema and D "
             "compute on fixed inputs after the last within {t.state:.0e}, each relative to the largest value "
             "compared ({precision}, no TF32); parameters are not compared one by one")


def report(differences: list[Difference], evidence: Evidence, cfg: Config, nproc: int,
           tolerance: Tolerance) -> list[str]:
    """The verdict's lines: the criterion, then EQUAL with the largest difference, or DIFFERENT with where the runs
    part, the first tensor that differs and the probable cause."""
    criterion = "criterion: " + CRITERION.format(t=tolerance, precision=cfg.train.precision)
    compared = "compared: " + ", ".join(
        f"{label} up to {max(d.relative for d in differences if d.kind == kind):.1e}"
        for kind, label in KINDS.items() if any(d.kind == kind for d in differences))
    first = next((d for d in differences if d.exceeds), None)
    if first is None:
        worst = max(differences, key=lambda d: d.relative / d.tolerance)
        return [criterion, compared, f"EQUAL: {nproc} processes train as 1 process; largest relative difference "
                                     f"{worst.relative:.1e} ({worst.what}, tolerance {worst.tolerance:.0e})"]
    tensor = next((d for d in differences if d.exceeds and d.kind != "loss"), first)
    cause, problem, fix = probable_cause(evidence)
    size = "not finite" if not math.isfinite(first.relative) else f"{first.relative:.1e}"
    return [criterion, compared,
            f"DIFFERENT: {nproc} processes do not train as 1 process",
            f"  first divergence: {first.where()}: {first.what} differs by {size} (tolerance {first.tolerance:.0e})",
            f"  first tensor that differs: {tensor.what} ({tensor.where()}, {tensor.relative:.1e})",
            f"  probable cause: {cause}: {problem}. Fix: {fix}"]
