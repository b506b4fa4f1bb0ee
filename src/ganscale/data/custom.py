"""The user's own data set (data.kind=custom): built from data.dataset, its first item checked."""

from __future__ import annotations

import numbers

import torch
from torch.utils.data import Dataset

from ganscale import usercode
from ganscale.config import Config, ConfigError
from ganscale.data.folder import BadItem

LABEL_FIX = "return (image, class index) with every index in [0, model.n_classes), or set model.n_classes"
ITEMS = {"unconditional": "an image tensor", "class-conditional": "(image, label)", "paired": "(input, target)"}


class BadLabel(BadItem):
    """An item's label outside model.n_classes' classes, found while training reads it: embedding it would fail inside
    G or D with torch's IndexError (a device-side assert on a GPU)."""

    key = "data.dataset"
    fix = LABEL_FIX


class BadUserItem(BadItem):
    """An item unlike the one the preflight checked (other fields, shape or range), found while training reads it:
    batching it would fail with torch's collate error, or it would train silently out of range."""

    key = "data.dataset"
    fix = "return from every item the fields, shape and [-1, 1] range that item 0 has (item 0 is checked before " \
          "training, the others as training reads them)"


class FailedUserItem(BadItem):
    """An item whose __getitem__ raised (a file that does not read, say): the same item would fail again on a
    restart."""

    key = "data.dataset"
    fix = "make __getitem__ return that item (replace or remove what it reads), or leave it out of the data set"


class UserDataset(Dataset):
    """The user's map-style data set, each item as a tuple of fields: (image,), (image, label) or (input, target).
    Every item is checked as it is read, before it reaches a batch: its fields, their shapes and range, its label.
    Floating images are taken as float32, the networks' input (a float64 image would fail in D's first layer)."""

    def __init__(self, items: Dataset, task: str, shape: tuple[int, ...], n_classes: int):
        self.items, self.task, self.shape, self.n_classes = items, task, shape, n_classes

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple:
        item = _read(self.items, index)
        problem = item_problem(item, index, self.task, self.shape, self.n_classes)
        if problem:
            raise (BadLabel if problem[1] == LABEL_FIX else BadUserItem)(problem[0])
        images = len(item) if self.task == "paired" else 1
        return tuple(field.float() if i < images else field for i, field in enumerate(item))


def _read(items: Dataset, index: int) -> tuple:
    """Item `index` as a tuple of fields; the user's own error reading it a FailedUserItem."""
    try:
        item = items[index]
    except Exception as e:  # noqa: BLE001 - the user's code failing: one line naming the item, not a traceback
        raised = usercode.raised_at(e)
        place = f" at {raised}" if raised else ""
        raise FailedUserItem(f"item {index} failed to load ({usercode.one_line(e)}){place}") from None
    return tuple(item) if isinstance(item, (tuple, list)) else (item,)


def label_problem(label, index: int, n_classes: int) -> str | None:
    """What is wrong with item `index`'s label, or None for an integer class in [0, n_classes)."""
    # numpy's integers count (labels read from an array); a tensor must be 0-d: a (1,) one batches to (B, 1)
    integer = (isinstance(label, numbers.Integral) and not isinstance(label, bool)) or (
        isinstance(label, torch.Tensor) and label.dim() == 0 and not label.is_floating_point()
        and label.dtype != torch.bool)
    if integer and 0 <= int(label) < n_classes:
        return None
    return f"item {index}'s label is {label!r}, not an integer class in [0, {n_classes})"


def user_dataset(cfg: Config) -> UserDataset:
    d = cfg.data
    items = usercode.build(d.dataset, d.dataset_args, "data.dataset", cfg.code_path)
    if not (hasattr(items, "__getitem__") and hasattr(items, "__len__")):
        raise ConfigError("data.dataset", f"{d.dataset} returned a {type(items).__name__}, not a map-style data set",
                          "return a torch.utils.data.Dataset with __len__ and __getitem__")
    if len(items) == 0:
        raise ConfigError("data.dataset", f"{d.dataset} returned an empty data set", "return at least one item")
    task, shape = cfg.model.conditioning, tuple(cfg.data.sample_shape)
    try:
        first = _read(items, 0)
    except FailedUserItem as e:
        raise ConfigError("data.dataset", e.problem(), e.fix) from None
    problem = item_problem(first, 0, task, shape, cfg.model.n_classes)
    if problem:  # before training: a config error (a later item's is a BadItem, said as training reads it)
        raise ConfigError("data.dataset", *problem)
    return UserDataset(items, task, shape, cfg.model.n_classes)


FIRST_ITEMS = 16  # read for the range warning: enough that a dark [-1, 1] image set has a negative value


def unit_range_warning(items: Dataset, task: str) -> str | None:
    """A warning where the first items' images hold no negative value: [0, 1] images (torchvision's ToTensor), which
    pass the [-1, 1] check but are not what ganscale's networks, sample grids and metrics take them for."""
    images = 2 if task == "paired" else 1
    fields = [field for index in range(min(FIRST_ITEMS, len(items))) for field in _good_item(items, index)[:images]]
    if not fields or min(float(field.min()) for field in fields) < 0 or max(float(field.max()) for field in fields) <= 0:
        return None
    return (f"data.dataset's images have no negative value in its first {min(FIRST_ITEMS, len(items))} items: "
            "[0, 1] images, where ganscale reads [-1, 1] (G's tanh spans both halves, sample grids show them pale); "
            "map them with image * 2 - 1")


def _good_item(items: Dataset, index: int) -> tuple:
    """Item `index`, or () where it is bad: training says so when it reads it (only item 0 is refused before)."""
    try:
        return items[index]
    except BadItem:
        return ()


def item_problem(item: tuple, index: int, task: str, shape: tuple[int, ...], n_classes: int
                 ) -> tuple[str, str] | None:
    """(problem, fix) when item `index` lacks the fields the task takes, each of the sample's shape and in [-1, 1],
    or (a class-conditional task's) an integer label in [0, n_classes); None when it is fine. Any floating dtype is
    fine (UserDataset casts it to float32)."""
    expected = f"{ITEMS[task]}, each image a float tensor of shape {shape} in [-1, 1]"
    fields = 1 if task == "unconditional" else 2
    images = item if task == "paired" else item[:1]
    if len(item) != fields or not all(isinstance(image, torch.Tensor) for image in images):
        return (f"item {index} is {_describe(item)}; model task {task} takes {expected}",
                f"return {ITEMS[task]} from __getitem__, or change model.task")
    for image in images:
        if not image.is_floating_point():
            return (f"item {index} holds a {image.dtype} tensor, not a floating-point one",
                    "return float images in [-1, 1] (x / 127.5 - 1 for bytes)")
        if tuple(image.shape) != shape:
            return (f"item {index} holds a {image.dtype} tensor of shape {tuple(image.shape)}, not {shape}",
                    "return images of that shape, or set data.channels and data.resolution to the data's shape")
        if not bool(image.isfinite().all()):
            return (f"item {index} holds NaN or infinite values", "return finite images in [-1, 1]")
        if image.numel() and not -1 <= float(image.min()) <= float(image.max()) <= 1:
            return (f"item {index} has values in [{float(image.min()):g}, {float(image.max()):g}]",
                    "scale images to [-1, 1] (x / 127.5 - 1 for bytes)")
    problem = label_problem(item[1], index, n_classes) if task == "class-conditional" else None
    return (problem, LABEL_FIX) if problem else None


def _describe(item: tuple) -> str:
    parts = [f"tensor{tuple(f.shape)}" if isinstance(f, torch.Tensor) else type(f).__name__ for f in item]
    return parts[0] if len(parts) == 1 else f"({', '.join(parts)})"
