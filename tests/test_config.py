"""Config loading, overrides and the cross-field checks, in process (no training)."""

from __future__ import annotations

import pytest
import yaml
from PIL import Image

from ganscale import config, preflight
from ganscale.config import Config, ConfigError
from image_helpers import write_nvlabs_zip


# ------------------------------------------------------------------------------------------ recipes
def test_there_are_shipped_recipes_and_the_default_is_one_of_them():
    names = config.recipe_names()
    assert {"digits", "ring8", "grid25"} <= set(names)
    assert config.DEFAULT_RECIPE in names


@pytest.mark.parametrize("name", config.recipe_names())
@pytest.mark.parametrize("world", [1, 2])
def test_every_shipped_recipe_loads_and_passes_check(name, world, tmp_path):
    # Recipes for the user's own images (pix2pix, a StyleGAN zip) name no data: give them some.
    data = config.load_raw(name).get("data", {})
    user_data = {"folder": tmp_path, "paired": tmp_path, "zip": tmp_path / "data.zip"}.get(data.get("kind"))
    if data.get("kind") == "zip":
        side = data["resolution"]
        write_nvlabs_zip(user_data, [Image.new("RGB", (side, side))] * 2)
    cfg = config.load(name, [f"data.path={user_data}"] if user_data else [])
    assert isinstance(cfg, Config)
    assert cfg.name == name
    assert cfg.description, f"recipe {name} has no description"
    if cfg.train.batch_size % world:  # the reference pix2pix trains at batch 1: more ranks need a larger batch
        with pytest.raises(ConfigError) as info:
            preflight.check(cfg, world, False)
        assert info.value.key == "train.batch_size"
        return
    preflight.check(cfg, world, False)  # raises on any bad combination
    # the derived batch split is consistent for the world size the check accepted
    assert cfg.micro_batch(world) * world * cfg.accumulation_steps(world) == cfg.train.batch_size


def test_recipe_yaml_round_trips_through_to_yaml():
    for name in config.recipe_names():
        cfg = config.load(name)
        assert config.build(yaml.safe_load(config.to_yaml(cfg))) == cfg


def test_a_written_config_leaves_out_the_options_nothing_in_it_reads(tmp_path):
    """A custom GAN's config.yaml listed g_width, mapping_layers, channel_base...: options its networks never get.
    Left out at their defaults (loading gives them back); an older version's full text still compares equal, so a
    resume writes no config.resumed file for it."""
    from ganscale import rundir

    custom = config.load("digits", ["model.kind=custom", "model.generator=nets:G", "model.discriminator=nets:D"],
                         files_here=False)
    written = yaml.safe_load(config.to_yaml(custom))["model"]
    assert {"g_width", "d_width", "g_batchnorm", "mapping_layers", "channel_base", "norm"}.isdisjoint(written)
    assert written["generator"] == "nets:G" and "z_dim" in written
    stylegan2 = yaml.safe_load(config.to_yaml(config.load("digits-stylegan2")))["model"]
    assert "mapping_layers" in stylegan2 and "g_width" not in stylegan2

    older = yaml.safe_dump(custom.model_dump(mode="json"), sort_keys=False)  # every option, as before
    assert config.settings_in(older) == config.settings_in(config.to_yaml(custom)) and older != config.to_yaml(custom)
    (tmp_path / "config.yaml").write_text(older)
    assert rundir.config_to_write(tmp_path, 10, config.to_yaml(custom)) is None
    changed = custom.model_copy(update={"name": "renamed"})
    assert rundir.config_to_write(tmp_path, 10, config.to_yaml(changed)) == tmp_path / "config.resumed-00000010.yaml"


def test_no_source_means_the_default_recipe():
    assert config.load(None) == config.load(config.DEFAULT_RECIPE)


# ---------------------------------------------------------------------------------------- overrides
def test_override_sets_nested_value_parsed_as_yaml():
    cfg = config.load(None, ["train.steps=3", "optim.g.betas=[0.1, 0.2]", "parallel.sync_bn=true"])
    assert cfg.train.steps == 3
    assert cfg.optim.g.betas == (0.1, 0.2)
    assert cfg.parallel.sync_bn is True
    assert cfg.optim.d.betas == config.load(None).optim.d.betas  # sibling untouched


def test_apply_override_on_raw_dict():
    raw: dict = {"train": {"steps": 1}}
    config.apply_override(raw, "train.seed=7")
    config.apply_override(raw, "log.every=3")
    assert raw == {"train": {"steps": 1, "seed": 7}, "log": {"every": 3}}


def test_unknown_key_names_it_and_suggests_the_close_one():
    with pytest.raises(ConfigError) as info:
        config.load(None, ["train.stpes=3"])
    assert info.value.key == "train.stpes"
    assert "train.steps" in str(info.value)
    assert "train.steps" in info.value.fix


def test_unknown_key_via_apply_override_then_build():
    raw = config.load_raw(None)
    config.apply_override(raw, "train.stpes=3")
    with pytest.raises(ConfigError) as info:
        config.build(raw)
    assert info.value.key == "train.stpes"
    assert "train.steps" in info.value.fix


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError) as info:
        config.load(None, ["train.steps=abc"])
    assert info.value.key == "train.steps"
    assert "train.steps" in str(info.value)
    assert "abc" in info.value.problem


def test_out_of_range_value_names_the_key():
    with pytest.raises(ConfigError) as info:
        config.load(None, ["train.steps=0"])
    assert info.value.key == "train.steps"


@pytest.mark.parametrize("assignment", ["train.steps", "=3"])
def test_malformed_override_is_a_config_error(assignment):
    with pytest.raises(ConfigError):
        config.load(None, [assignment])


def test_override_through_a_value_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        config.load(None, ["train.steps.x=1"])
    assert "steps" in info.value.problem


# ------------------------------------------------------------------------------------------- checks
def test_batch_not_divisible_by_world():
    cfg = config.load(None, ["train.batch_size=63"])
    preflight.check(cfg, 1, False)  # fine on one process
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 2, False)
    assert info.value.key == "train.batch_size"


def test_batch_not_divisible_by_world_times_micro_batch():
    cfg = config.load(None, ["train.batch_size=64", "train.micro_batch=5"])
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 2, False)
    assert info.value.key == "train.batch_size"
    # the same micro-batch fits a batch that is a multiple of world x micro
    preflight.check(config.load(None, ["train.batch_size=60", "train.micro_batch=5"]), 2, False)


def test_fp16_on_cpu_is_rejected_but_allowed_with_cuda():
    cfg = config.load(None, ["train.precision=fp16"])
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 1, False)
    assert info.value.key == "train.precision"
    preflight.check(cfg, 1, True)  # device auto with a visible GPU: fine
    preflight.check(config.load(None, ["train.precision=bf16"]), 1, False)  # bf16 is fine on the CPU


def test_cuda_device_without_cuda_is_rejected():
    with pytest.raises(ConfigError) as info:
        preflight.check(config.load(None, ["train.device=cuda"]), 1, False)
    assert info.value.key == "train.device"


def test_mlp_model_with_image_data_is_rejected():
    cfg = config.load(None, ["model.kind=mlp"])
    assert cfg.data.kind == "digits"
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 1, False)
    assert info.value.key == "model.kind"


def test_dcgan_model_with_2d_data_is_rejected():
    with pytest.raises(ConfigError) as info:
        preflight.check(config.load("ring8", ["model.kind=dcgan"]), 1, False)
    assert info.value.key == "model.kind"


@pytest.mark.parametrize("recipe, overrides, key, said", [
    ("digits-stylegan2", ["model.d_spectral_norm=true"], "model.d_spectral_norm", "not model.kind=stylegan2"),
    ("digits-biggan", ["model.d_spectral_norm=true"], "model.d_spectral_norm", "not model.kind=biggan"),
    ("digits-stylegan2", ["model.g_width=32"], "model.g_width", "model.channel_base"),
    ("digits-stylegan2", ["model.g_batchnorm=false"], "model.g_batchnorm", "model.kind=dcgan or mlp"),
    ("digits-stylegan2", ["model.g_layers=2"], "model.g_layers", "mlp networks only"),
    ("digits", ["model.norm=instance"], "model.norm", "pix2pix only"),
    ("digits", ["model.channel_base=64"], "model.channel_base", "stylegan2 only"),
    ("digits", ["model.attn_resolution=4"], "model.attn_resolution", "biggan only"),
    ("digits", ["augment.kind=ada", "augment.policy=[color]"], "augment.policy", "augment.kind=diffaugment only"),
    ("digits", ["augment.kind=diffaugment", "augment.ada_ops=[xflip]"], "augment.ada_ops", "augment.kind=ada only"),
    ("digits", ["augment.kind=diffaugment", "augment.p=0.5"], "augment.p", "not augment.kind=diffaugment"),
    ("digits", ["loss.gp_weight=5"], "loss.gp_weight", "the gradient penalty only"),
    ("digits", ["model.n_classes=5"], "model.n_classes", "class-conditional models, not model.kind=dcgan"),
    ("digits-stylegan2", ["model.n_classes=5"], "model.n_classes", "model.conditional=false"),
    ("digits", ["data.path=/data/faces"], "data.path", "data.kind=folder, zip and paired, not data.kind=digits"),
    ("digits", ["data.direction=BtoA"], "data.direction", "data.kind=paired only"),
    ("digits", ["data.load_size=64"], "data.load_size", "data.kind=paired only"),
    ("digits", ["data.size=5"], "data.size", "2D mixtures"),
    ("digits", ["loss.pl_interval=8"], "loss.pl_interval", "path length regularisation only, not model.kind=dcgan"),
    ("digits-biggan", ["loss.pl_batch_shrink=4"], "loss.pl_batch_shrink", "not model.kind=biggan"),
    ("ring8", ["loss.pl_decay=0.5"], "loss.pl_decay", "not model.kind=mlp"),
])
def test_an_option_nothing_reads_in_this_config_is_refused_naming_it(recipe, overrides, key, said):
    """A value other than the default of an option that this model, augmentation, loss or data source never reads
    (data.direction on a data set of pairs that is not data.kind=paired: the run trained AtoB, its config said BtoA)."""
    with pytest.raises(ConfigError) as info:
        preflight.check(config.load(recipe, overrides), 1, False)
    assert info.value.key == key and said in str(info.value), str(info.value)
    assert f"set {key}=" in info.value.fix


@pytest.mark.parametrize("recipe, overrides", [
    ("digits", ["model.d_spectral_norm=true", "model.g_batchnorm=false"]),  # DCGAN reads both
    ("digits", ["augment.kind=ada", "augment.p=0.5", "augment.ada_ops=[xflip]"]),
    ("digits", ["augment.kind=diffaugment", "augment.policy=[color]"]),
    ("digits", ["loss.kind=wgan-gp", "loss.gp_weight=5"]),
    ("digits", ["loss.gradient_penalty=true", "loss.gp_weight=5"]),
    ("digits-stylegan2", ["model.g_width=64", "model.norm=batch"]),  # defaults, even where nothing reads them
    # augmentation switched off keeps its settings (to switch it on again): not refused
    ("digits", ["augment.kind=none", "augment.p=0.5", "augment.policy=[color]"]),
    ("ring8", ["data.size=500"]),
    # as augment.kind=none, a regularisation switched off keeps its settings (the recipe's loss.r1_interval=16)
    ("digits-stylegan2", ["loss.r1_gamma=0", "loss.pl_weight=0", "loss.pl_interval=8", "loss.pl_decay=0.5"]),
    ("digits-stylegan2", ["loss.pl_batch_shrink=4"]),
])
def test_options_the_config_reads_or_left_at_their_default_pass(recipe, overrides):
    preflight.check(config.load(recipe, overrides), 1, False)


def test_batchnorm_with_one_sample_per_rank_is_rejected_unless_sync_bn():
    cfg = config.load(None, ["train.batch_size=2", "parallel.sync_bn=false"])
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 2, False)
    assert info.value.key == "train.micro_batch"
    preflight.check(config.load(None, ["train.batch_size=2", "parallel.sync_bn=true"]), 2, False)
    preflight.check(config.load(None, ["train.batch_size=2"]), 2, False)  # unset: cross-rank (the default)


@pytest.mark.parametrize("overrides, world, across", [
    ([], 2, True),                                     # the default: what one process normalises together
    ([], 1, False),                                    # one process: plain BatchNorm
    (["parallel.sync_bn=false"], 2, False),            # as set
    (["train.micro_batch=8"], 2, False),               # each rank normalises a micro-batch as one process does
    (["train.micro_batch=8", "parallel.sync_bn=true"], 2, True),
    (["parallel.generator=pipeline", "parallel.discriminator=pipeline"], 2, False),  # per pipeline micro-batch
    (["loss.r1_gamma=1"], 2, True),                    # DCGAN's D has no BatchNorm: R1 does not pass one
])
def test_cross_rank_batchnorm_is_the_default_wherever_it_trains_as_one_process(overrides, world, across):
    assert preflight.cross_rank_batchnorm(config.load(None, overrides), world) is across


def test_cross_rank_batchnorm_stays_off_unset_where_r1_passes_batchnorm_in_d(tmp_path):
    pix2pix = ["data.kind=paired", f"data.path={tmp_path}", "model.kind=pix2pix", "data.resolution=64",
               "data.channels=3", "train.batch_size=4", "model.norm=batch"]
    assert preflight.cross_rank_batchnorm(config.load(None, [*pix2pix, "loss.r1_gamma=1"]), 2) is False
    assert preflight.cross_rank_batchnorm(config.load(None, pix2pix), 2) is True


@pytest.mark.parametrize("recipe, network", [("pix2pix", "UNetGenerator"), ("digits-biggan", "BigGANGenerator")])
def test_pipeline_of_a_model_it_cannot_split_is_refused_for_that_first(tmp_path, recipe, network):
    """Not for BatchNorm with one sample per micro-batch, whose fix (model.g_batchnorm) does nothing here."""
    pipeline = ["parallel.generator=pipeline", "parallel.discriminator=pipeline", "train.batch_size=4"]
    cfg = config.load(recipe, [*pipeline, f"data.path={tmp_path}"] if recipe == "pix2pix" else pipeline)
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 2, False)
    assert info.value.key == "parallel.generator"
    assert f"{network} is not a sequence of layers the pipeline can split" in str(info.value)


def test_r1_through_cross_rank_batchnorm_in_d_is_refused(tmp_path):
    penalty = "loss.r1_gamma=1"  # (wgan-gp is refused for pix2pix anyway)
    pix2pix = ["data.kind=paired", f"data.path={tmp_path}", "model.kind=pix2pix", "data.resolution=64",
               "data.channels=3", "train.batch_size=4", "parallel.sync_bn=true", penalty]
    with pytest.raises(ConfigError) as info:  # the PatchGAN has BatchNorm with model.norm=batch
        preflight.check(config.load(None, [*pix2pix, "model.norm=batch"]), 2, False)
    assert info.value.key == "parallel.sync_bn" and "double backward" in str(info.value)
    preflight.check(config.load(None, [*pix2pix, "model.norm=instance"]), 2, False)  # no BatchNorm in D
    preflight.check(config.load(None, [*pix2pix, "model.norm=batch"]), 1, False)  # one process: plain BatchNorm
    preflight.check(config.load(None, ["parallel.sync_bn=true", penalty]), 2, False)  # DCGAN: BatchNorm in G only


def test_folder_data_needs_an_existing_directory(tmp_path):
    with pytest.raises(ConfigError) as info:
        preflight.check(config.load(None, ["data.kind=folder"]), 1, False)
    assert info.value.key == "data.path"
    with pytest.raises(ConfigError) as info:
        preflight.check(config.load(None, ["data.kind=folder", f"data.path={tmp_path / 'nope'}"]), 1, False)
    assert info.value.key == "data.path"
    preflight.check(config.load(None, ["data.kind=folder", f"data.path={tmp_path}"]), 1, False)


def test_dcgan_needs_power_of_two_resolution():
    with pytest.raises(ConfigError) as info:
        preflight.check(config.load(None, ["data.resolution=12"]), 1, False)
    assert info.value.key == "data.resolution"


# ------------------------------------------------------------------------------------ YAML sources
def test_yaml_file_source(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  steps: 7\n  batch_size: 32\nlog:\n  every: 2\n")
    cfg = config.load(str(path), ["train.seed=5"])
    assert cfg.name == "mine"  # the file's stem names the run
    assert (cfg.train.steps, cfg.train.batch_size, cfg.log.every, cfg.train.seed) == (7, 32, 2, 5)
    assert cfg.model == Config().model  # everything unspecified takes the defaults
    preflight.check(cfg, 2, False)


def test_yaml_file_with_explicit_name_keeps_it(tmp_path):
    path = tmp_path / "file.yaml"
    path.write_text("name: explicit\n")
    assert config.load(str(path)).name == "explicit"


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        config.load(str(tmp_path / "absent.yaml"))
    assert "absent.yaml" in info.value.problem
    assert "digits" in info.value.fix  # lists the shipped recipes


def test_non_mapping_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        config.load(str(path))
    assert "mapping" in info.value.problem


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_an_empty_yaml_file_is_refused(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config.load(str(path))
    assert info.value.key == str(path) and "no settings" in info.value.problem


@pytest.mark.parametrize("text", ["train:\n  steps: 5\n  steps: 7\n", "train: {steps: 5}\ntrain: {steps: 7}\n"])
def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_it(tmp_path, text):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config.load(str(path))
    assert info.value.key == str(path)
    assert "the key 'train' is given twice" in info.value.problem or "the key 'steps' is given twice" in info.value.problem
    assert ", column " in info.value.problem  # where


def test_a_key_given_twice_in_an_override_value_is_refused():
    with pytest.raises(ConfigError) as info:
        config.load("digits", ["optim.betas={a: 1, a: 2}"])
    assert "given twice" in info.value.problem


def test_invalid_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train: {steps: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        config.load(str(path))
    assert info.value.key == str(path)


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("model:\n  z_dimm: 3\n")
    with pytest.raises(ConfigError) as info:
        config.load(str(path))
    assert info.value.key == "model.z_dimm"
    assert "model.z_dim" in info.value.fix


# ------------------------------------------------------------------------------ batch derivation
def test_accumulation_from_explicit_micro_batch():
    cfg = config.load(None, ["train.batch_size=64", "train.micro_batch=8"])
    assert cfg.micro_batch(2) == 8
    assert cfg.accumulation_steps(2) == 4
    assert cfg.micro_batch(1) == 8
    assert cfg.accumulation_steps(1) == 8


def test_default_micro_batch_splits_the_batch_over_ranks():
    cfg = config.load(None, ["train.batch_size=64"])
    assert cfg.train.micro_batch is None
    assert cfg.micro_batch(2) == 32
    assert cfg.accumulation_steps(2) == 1
    assert cfg.micro_batch(1) == 64
    assert cfg.accumulation_steps(1) == 1


# ------------------------------------------------------------------------- bad values: ConfigError, not a traceback
def _refused(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config.load(None, overrides)
    return info.value


@pytest.mark.parametrize("value", ["[1,2", "{a: 1", "'open", "!!python/object:os.system x"])
def test_override_value_that_is_not_yaml_names_the_key(value):
    error = _refused([f"train.steps={value}"])
    assert error.key == "train.steps"
    assert "not valid YAML" in error.problem and "\n" not in str(error)


@pytest.mark.parametrize("betas, item, phrase", [("[1.5, 0.9]", 0, "less than 1"), ("[0.5, 1]", 1, "less than 1"),
                                                 ("[-0.1, 0.9]", 0, "greater than or equal to 0")])
def test_adam_betas_must_lie_in_zero_one(betas, item, phrase):
    error = _refused([f"optim.g.betas={betas}"])
    assert error.key == "optim.g.betas"  # the option, not optim.g.betas.0
    assert f"item {item}" in error.problem and phrase in error.problem
    assert config.load(None, ["optim.d.betas=[0, 0.999]"]).optim.d.betas == (0.0, 0.999)  # 0 is fine (BigGAN)


@pytest.mark.parametrize("assignment, phrase", [("optim.g.lr=0", "greater than 0"),
                                                ("optim.d.weight_decay=-1e-4", "greater than or equal to 0")])
def test_adam_lr_and_weight_decay_ranges(assignment, phrase):
    error = _refused([assignment])
    assert error.key == assignment.split("=")[0] and phrase in error.problem


@pytest.mark.parametrize("seed", ["99999999999999999999", "4294967296", "-1"])
def test_seed_is_bounded_to_what_every_derived_seed_accepts(seed):
    error = _refused([f"train.seed={seed}"])
    assert error.key == "train.seed"
    assert "less than 4294967296" in error.problem or "greater than or equal to 0" in error.problem
    assert config.load(None, [f"train.seed={2**32 - 1}"]).train.seed == 2**32 - 1


@pytest.mark.parametrize("key", ["train.steps", "checkpoint.every", "log.every", "log.sample_every", "eval.every",
                                 "loss.r1_interval"])
def test_step_counts_have_an_upper_bound(key):
    error = _refused([f"{key}=99999999999999999999"])
    assert error.key == key and "less than or equal to 1000000000" in error.problem
    assert config.load(None, [f"train.steps={config.MAX_STEPS}"]).train.steps == config.MAX_STEPS


def test_other_integers_must_fit_int64():
    error = _refused(["model.z_dim=99999999999999999999"])
    assert error.key == "model.z_dim" and "too large" in error.problem


@pytest.mark.parametrize("key", ["optim.g.lr", "optim.d.betas", "optim.g.weight_decay", "loss.r1_gamma",
                                 "loss.gp_weight", "loss.l1_weight", "train.grad_clip", "train.ema_half_life_images",
                                 "train.ema_rampup", "optim.decay_start", "parallel.timeout_s",
                                 "fault.hang_timeout_s", "fault.exit_timeout_s"])
@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf", "inf", "nan"])
def test_float_options_refuse_inf_and_nan(key, value):
    error = _refused([f"{key}=[{value}, 0.9]" if key.endswith("betas") else f"{key}={value}"])
    assert error.key == key and "finite number" in error.problem


def test_every_float_option_refuses_inf():
    """One mechanism (the sections' allow_inf_nan=False) covers every float field, present and future."""
    def floats(model: type, prefix: str):
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, config.Section):
                yield from floats(field.annotation, f"{prefix}{name}.")
            elif field.annotation is float:
                yield f"{prefix}{name}"
    keys = list(floats(Config, ""))
    assert "optim.g.lr" in keys and "fault.exit_timeout_s" in keys
    for key in keys:
        assert _refused([f"{key}=.inf"]).key == key


def test_timeouts_are_bounded():
    error = _refused(["parallel.timeout_s=1e20"])  # datetime.timedelta overflows near 1e14 s
    assert error.key == "parallel.timeout_s" and "less than or equal to" in error.problem


def test_binary_recipe_file_is_a_config_error(tmp_path):
    path = tmp_path / "random.yaml"
    path.write_bytes(bytes(range(128, 256)) * 16)
    with pytest.raises(ConfigError) as info:
        config.load(str(path))
    assert info.value.key == str(path) and "not a text file" in info.value.problem


def test_invalid_yaml_file_message_is_one_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train: {steps: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        config.load(str(path))
    assert "not valid YAML" in info.value.problem and "line 2" in info.value.problem and "\n" not in str(info.value)


def test_data_workers_are_bounded():
    error = _refused(["data.workers=500"])
    assert error.key == "data.workers" and "less than or equal to 64" in error.problem
    assert config.load(None, ["data.workers=64"]).data.workers == 64


@pytest.mark.parametrize("assignment", ["train.steps=true", "train.seed=false", "optim.g.lr=true",
                                        "loss.r1_gamma=false", "optim.g.betas=[true, 0.9]", "train.micro_batch=true",
                                        "parallel.mesh=[true, 2]"])
def test_booleans_are_not_numbers(assignment):
    error = _refused([assignment])
    assert error.key == assignment.split("=")[0] and "not true/false" in error.problem


def test_numbers_from_set_strings_still_parse():
    # --set values are YAML: 1e-3 is a string to PyYAML, 10.0 a float; both are meant as numbers
    cfg = config.load(None, ["train.steps=10", "optim.g.lr=1e-3", "optim.d.lr=2.0e-4", "log.every=10.0",
                             "train.micro_batch=null", "parallel.sync_bn=true"])
    assert (cfg.train.steps, cfg.optim.g.lr, cfg.optim.d.lr, cfg.log.every) == (10, 1e-3, 2e-4, 10)
    assert cfg.train.micro_batch is None and cfg.parallel.sync_bn is True


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ".", "a\\b", "runs*", "x\ny", "n" * 201])
def test_run_name_is_one_path_component(name):
    error = _refused([f"name={name!r}" if "\n" in name else f"name={name}"])
    assert error.key == "name" and "one path component" in error.problem


def test_ordinary_run_names_are_accepted(tmp_path):
    assert config.load(None, ["name=my-run_v2.1"]).name == "my-run_v2.1"
    path = tmp_path / "exp 1.yaml"  # a file's stem names the run: spaces are fine
    path.write_text("train: {steps: 3}\n")
    assert config.load(str(path)).name == "exp 1"


def test_an_unquoted_off_is_the_compile_mode_off():
    """YAML reads `off` as false; `--set train.compile=off` failed with "got False"."""
    assert config.load(None, ["train.compile=off"]).train.compile == "off"
    with pytest.raises(ConfigError, match="train.compile"):
        config.load(None, ["train.compile=true"])


def test_file_paths_are_recorded_absolute_and_a_run_s_own_config_loads_back_unchanged(tmp_path, monkeypatch):
    """A resume or eval from another folder read a relative data.path there (other images, silently), and
    loading a run's own config put its run folder on code_path, so every plain resume wrote a changed config."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    cfg = config.load(None, ["data.kind=folder", "data.path=imgs/good", "eval.inception_weights=w.pt"])
    assert (cfg.data.path, cfg.eval.inception_weights) == (str(project / "imgs/good"), str(project / "w.pt"))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(config.to_yaml(cfg))
    monkeypatch.chdir(tmp_path)
    again = config.load(str(run / "config.yaml"))
    assert config.to_yaml(again) == (run / "config.yaml").read_text()  # nothing for a plain resume to record
    user_yaml = project / "gan.yaml"  # a user's own YAML file: its folder is searched for their modules
    user_yaml.write_text(config.to_yaml(cfg))
    assert config.load(str(user_yaml)).code_path == [str(project)]


def test_a_leading_tilde_in_a_path_is_the_user_s_home_as_a_shell_makes_it(tmp_path, monkeypatch):
    """`data.path: ~/faces` in a YAML file (or a quoted --set) has no shell to expand it: it was read as the folder
    './~/faces'. The data path, the Inception weights and code_path expand it; a k8s manifest's config keeps it as
    written (the pods' home is theirs)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "nets").mkdir()
    monkeypatch.chdir(tmp_path / "nets")
    cfg = config.load(None, ["data.kind=folder", "data.path=~/faces", "eval.inception_weights=~/w.pt",
                             "code_path=['~/nets']"])
    assert (cfg.data.path, cfg.eval.inception_weights) == (str(tmp_path / "faces"), str(tmp_path / "w.pt"))
    assert cfg.code_path[0] == str(tmp_path / "nets")
    assert config.load(None, ["data.kind=folder", "data.path=~/faces"], files_here=False).data.path == "~/faces"


def test_a_code_path_folder_that_does_not_exist_is_refused_naming_it(tmp_path):
    """A mistyped folder was skipped silently: the user's modules then came from another folder on the path."""
    (tmp_path / "nets").mkdir()
    user_yaml = tmp_path / "gan.yaml"
    user_yaml.write_text("code_path: [nets, netz]\n")
    with pytest.raises(ConfigError) as info:
        config.load(str(user_yaml))
    assert info.value.key == "code_path" and f"{tmp_path / 'netz'} is not a folder" in str(info.value)
    user_yaml.write_text("code_path: [nets]\n")
    assert config.load(str(user_yaml)).code_path == [str(tmp_path / "nets"), str(tmp_path)]
