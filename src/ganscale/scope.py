"""Which options a config reads: those that only some models, augmentations, losses or data sources read
(SCOPED_OPTIONS). The preflight refuses one set where nothing reads it; a run's written config leaves out those
left at their defaults (`unread`). Pure Python: `ganscale k8s` and `slurm` render configs without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ganscale.config import Config


def _kinds(*kinds: str):
    return lambda cfg: cfg.model.kind in kinds


_STYLEGAN2 = ("stylegan2 only", _kinds("stylegan2"), "use model.kind=stylegan2")
_MLP = ("the mlp networks only", _kinds("mlp"), "use model.kind=mlp (ring8/grid25)")
_PAIRED = ("data.kind=paired only", lambda cfg: cfg.data.kind == "paired",
           "use data.kind=paired (a data.kind=custom data set of pairs gives (input, target) in the order to learn)")
# augment.kind=none switches augmentation off and leaves its settings as they are: only the other kind's are refused.
_ADA = ("augment.kind=ada only", lambda cfg: cfg.augment.kind in ("ada", "none"), "set augment.kind=ada")
# Likewise loss.pl_weight=0 (and loss.r1_gamma=0, so loss.r1_interval has no entry) switches a regularisation off and
# keeps its settings (a stylegan2 recipe's, ablated with --set); only a model without path length regularisation
# refuses them.
_PATH_LENGTH = ("stylegan2's path length regularisation only", _kinds("stylegan2"),
                "use model.kind=stylegan2 with loss.pl_weight > 0 (StyleGAN2: 2)",
                lambda cfg: f"model.kind={cfg.model.kind}")


def _conditioning(cfg: Config) -> str:
    """The configured model with what decides what G is given (for the options only some tasks read)."""
    m = cfg.model
    if m.kind == "custom":
        return f"model.kind=custom with model.task={m.task}"
    return f"model.kind=stylegan2 with model.conditional={str(m.conditional).lower()}" if m.kind == "stylegan2" \
        else f"model.kind={m.kind}"


# Options that only some models, augmentations, losses or data sources read: key -> (where it applies, whether
# this config is there, how to get there[, what this config is, where the section's kind does not say it]).
# Elsewhere nothing reads them, so a value other than the field's default is refused.
# As the recipes carry only their own model's options, a default comparison suffices (a recipe's value that
# equals the default is not the user's choice, and a non-default one sits under the model that reads it).
SCOPED_OPTIONS = {
    "model.g_width": ("dcgan, mlp, biggan and pix2pix", _kinds("dcgan", "mlp", "biggan", "pix2pix"),
                      "use model.channel_base and model.channel_max for stylegan2's widths"),
    "model.d_width": ("dcgan, mlp, biggan and pix2pix", _kinds("dcgan", "mlp", "biggan", "pix2pix"),
                      "use model.channel_base and model.channel_max for stylegan2's widths"),
    "model.g_layers": _MLP,
    "model.d_layers": _MLP,
    "model.pack": ("the mlp discriminator only", _kinds("mlp"), "use model.kind=mlp (ring8/grid25)"),
    "model.d_maxout": ("the mlp discriminator only", _kinds("mlp"), "use model.kind=mlp (ring8/grid25)"),
    "model.g_batchnorm": ("dcgan and mlp", _kinds("dcgan", "mlp"),
                          "use model.kind=dcgan or mlp (biggan's G always has BatchNorm, pix2pix's is model.norm)"),
    "model.d_spectral_norm": ("dcgan and mlp", _kinds("dcgan", "mlp"),
                              "use model.kind=dcgan or mlp (biggan's D always is)"),
    "model.shared_dim": ("biggan only", _kinds("biggan"), "use model.kind=biggan"),
    "model.attn_resolution": ("biggan only", _kinds("biggan"), "use model.kind=biggan"),
    "model.mapping_layers": _STYLEGAN2,
    "model.channel_base": _STYLEGAN2,
    "model.channel_max": _STYLEGAN2,
    "model.style_mixing": _STYLEGAN2,
    "model.mbstd_group": _STYLEGAN2,
    "model.g_output": _STYLEGAN2,
    "model.norm": ("pix2pix only", _kinds("pix2pix"), "use model.kind=pix2pix"),
    "model.n_classes": ("class-conditional models", lambda cfg: cfg.model.conditioning == "class-conditional",
                        "use model.kind=biggan, stylegan2 with model.conditional=true, or custom with "
                        "model.task=class-conditional", _conditioning),
    "augment.p": _ADA,
    "augment.target": _ADA,
    "augment.interval": _ADA,
    "augment.speed_images": _ADA,
    "augment.ada_ops": _ADA,
    "augment.policy": ("augment.kind=diffaugment only", lambda cfg: cfg.augment.kind in ("diffaugment", "none"),
                       "set augment.kind=diffaugment"),
    "loss.gp_weight": ("the gradient penalty only", lambda cfg: cfg.loss.with_gradient_penalty,
                       "use loss.kind=wgan-gp or loss.gradient_penalty=true"),
    "loss.pl_interval": _PATH_LENGTH,
    "loss.pl_batch_shrink": _PATH_LENGTH,
    "loss.pl_decay": _PATH_LENGTH,
    "data.path": ("data.kind=folder, zip and paired", lambda cfg: cfg.data.kind in ("folder", "zip", "paired"),
                  "use data.kind=folder, zip or paired (data.kind=custom: give your data set its path in "
                  "data.dataset_args)"),
    "data.direction": _PAIRED,
    "data.load_size": _PAIRED,
    "data.size": ("the 2D mixtures (data.kind=ring8 and grid25) only", lambda cfg: cfg.data.kind in ("ring8", "grid25"),
                  "use data.kind=ring8 or grid25 (data.max_images trains on a subset of any data set)"),
}


def setting_of(cfg: Config, key: str) -> str:
    """What of `cfg` decides whether its section reads `key` (the section's kind)."""
    return {"model": f"model.kind={cfg.model.kind}", "augment": f"augment.kind={cfg.augment.kind}",
            "loss": f"loss.kind={cfg.loss.kind} without a gradient penalty",
            "data": f"data.kind={cfg.data.kind}"}[key.split(".")[0]]


def not_read(cfg: Config) -> list[tuple[str, object, object]]:
    """(key, value, default) of each option of SCOPED_OPTIONS that nothing in `cfg` reads."""
    found = []
    for key, (_, applies, *_rest) in SCOPED_OPTIONS.items():
        if not applies(cfg):
            section, name = key.split(".")
            part = getattr(cfg, section)
            found.append((key, getattr(part, name), type(part).model_fields[name].default))
    return found


def unread(cfg: Config) -> list[str]:
    """The options nothing in `cfg` reads, at their defaults (the preflight refuses any other value): what a run's
    written config leaves out, as loading it gives them back."""
    return [key for key, value, default in not_read(cfg) if value == default]
