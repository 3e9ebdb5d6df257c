"""wandistiller/data/images.py: image folders and `datasets` folders encoded once with the VAE; bad ones refused."""

from __future__ import annotations

import json
import logging
import os

import datasets
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from tests.conftest import refused
from wandistiller.core.errors import UserError
from wandistiller.data import images as image_data_module
from wandistiller.data.images import folder_source, image_data, to_pixels
from wandistiller.data.videos import folder_videos
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.teacher.vae import encode_images, load_vae

CAPTIONS = ["a red fox in snow", "a lighthouse at night", "a bowl of ramen"]
TEACHER = OmegaConf.create({"negative_prompt": "", "max_sequence_length": 512})


def images() -> list[Image.Image]:
    """Three small non-square images (so the crop matters), different in colour and structure."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (80 + 10 * i, 100, 3), dtype=np.uint8)) for i in range(3)]


def data_cfg(**kw):
    base = dict(root=None, dataset=None, image_column=None, text_column=None, latent_chunk=2)
    return OmegaConf.create(base | dict(latent_frames=1, latent_height=8, latent_width=8) | kw)


def write_folder(root, jsonl=False):
    root.mkdir()
    for i, (img, caption) in enumerate(zip(images(), CAPTIONS)):
        img.save(root / f"img{i}.png")
        if not jsonl:
            (root / f"img{i}.txt").write_text(caption + "\n")
    if jsonl:
        lines = [json.dumps({"file_name": f"img{i}.png", "text": c}) for i, c in enumerate(CAPTIONS)]
        (root / "captions.jsonl").write_text("\n".join(lines))
    return root


def load(spec, cfg, cache):
    return image_data(spec, cfg, TEACHER, torch.float32, torch.device("cpu"), cache, progress=False)


@pytest.mark.parametrize("jsonl", [False, True])
def test_a_captioned_folder_is_encoded_once_with_the_teachers_vae(jsonl, tiny_path, tmp_path, monkeypatch):
    spec = inspect_teacher(tiny_path)
    root = write_folder(tmp_path / "images", jsonl)
    emb, bank = load(spec, data_cfg(root=str(root)), tmp_path / "cache")
    assert emb.prompts == CAPTIONS and len(bank) == 3 and bank.latent_shape == (16, 1, 8, 8)
    assert bank.prompt_idx.tolist() == [0, 1, 2]
    vae = load_vae(spec, torch.device("cpu"))
    expected = encode_images(vae, torch.stack([to_pixels(img, 64, 64) for img in images()]))
    torch.testing.assert_close(bank.x0(torch.arange(3)), expected)
    monkeypatch.setattr(image_data_module, "load_vae", lambda *a: pytest.fail("a complete cache encodes nothing"))
    load(spec, data_cfg(root=str(root)), tmp_path / "cache")


def test_images_smaller_than_the_frame_are_said_to_train_blurred(tiny_path, tmp_path, caplog):
    # An audit's: 32x32 images trained at a larger frame, scaled up without a word (clips and first frames refuse).
    root = write_folder(tmp_path / "images")
    images()[1].resize((40, 30)).save(root / "img1.png")  # under the tiny teacher's 64x64 frame
    with caplog.at_level(logging.WARNING):
        load(inspect_teacher(tiny_path), data_cfg(root=str(root)), tmp_path / "cache")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    told = f"data.root={str(root)!r}: 1 of the images encoded (img1.png) are smaller than the frame and were scaled up"
    assert said == [told + ", so they train blurred; give larger images, or lower data.latent_height/latent_width"]


def test_a_datasets_folder_is_read_offline_and_matches_the_same_images_in_a_folder(tiny_path, tmp_path):
    spec = inspect_teacher(tiny_path)
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"image": images(), "caption": CAPTIONS}, features=features)
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "ds"))
    emb, bank = load(spec, data_cfg(dataset=str(tmp_path / "ds")), tmp_path / "cache")
    _, from_folder = load(spec, data_cfg(root=str(write_folder(tmp_path / "images"))), tmp_path / "cache")
    assert emb.prompts == CAPTIONS
    torch.testing.assert_close(bank.x0(torch.arange(3)), from_folder.x0(torch.arange(3)))


def bad_folder(tmp_path, damage):
    root = write_folder(tmp_path / "images")
    if damage == "empty":
        for p in root.iterdir():
            p.unlink()
    elif damage == "unreadable":
        (root / "img1.png").write_bytes(b"not a png at all")
    elif damage == "uncaptioned":
        (root / "img2.txt").unlink()
    elif damage in ("a_gif", "gifs_only", "animated_webp"):
        frames = [Image.new("RGB", (32, 32), (40 * i, 0, 0)) for i in range(3)]
        name = "clip.webp" if damage == "animated_webp" else "clip.gif"
        frames[0].save(root / name, save_all=True, append_images=frames[1:], duration=100)
        (root / name).with_suffix(".txt").write_text("a clip\n")
        if damage == "gifs_only":
            for p in root.glob("img*"):
                p.unlink()
    return data_cfg(root=str(root))


def bad_dataset(tmp_path, damage):
    columns = {"image": images(), "caption": CAPTIONS}
    del columns["image" if damage == "no_image_column" else "caption"]
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "ds"))
    return data_cfg(dataset=str(tmp_path / "ds"))


@pytest.mark.parametrize(
    "make,damage,message",
    [
        (bad_folder, "empty", r"data.root=.* holds no images"),
        (bad_folder, "unreadable", r"data.root=.*img1.png is not a readable image"),
        (bad_folder, "uncaptioned", r"data.root=.*img2.png has no caption"),
        # A clip among the images was dropped (a GIF) or read as its first frame (an animated WebP): named instead.
        (bad_folder, "a_gif", r"data.root=.*: clip.gif is a video, and data=image_folder takes stills; for clips use"),
        (bad_folder, "gifs_only", r"data.root=.* holds no images .*; it holds videos: use data=video_folder$"),
        (bad_folder, "animated_webp", r"data.root=.*: clip.webp is animated \(3 frames\), and data=image_folder"),
        (bad_dataset, "no_image_column", r"data.dataset=.* has no image column"),
        (bad_dataset, "no_text_column", r"data.dataset=.* has no text column"),
    ],
)
def test_bad_image_data_is_one_line_naming_the_key(tiny_path, tmp_path, make, damage, message):
    with pytest.raises(UserError, match=message) as e:
        load(inspect_teacher(tiny_path), make(tmp_path, damage), tmp_path / "cache")
    assert "\n" not in str(e.value)


def saved_dataset(tmp_path, columns=None, features=None, dict_=True):
    columns = columns or {"image": images(), "caption": CAPTIONS}
    features = features or datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")})
    ds = datasets.Dataset.from_dict(columns, features=features)
    (datasets.DatasetDict({"train": ds}) if dict_ else ds).save_to_disk(str(tmp_path / "ds"))
    return tmp_path / "ds"


@pytest.mark.parametrize("name", ["../outside.arrow", "/etc/passwd", "sub/../../x.arrow"])
def test_a_dataset_naming_files_outside_its_folder_is_refused_before_reading(tiny_path, tmp_path, name):
    folder = saved_dataset(tmp_path, dict_=False)
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": name}]
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match=r"state.json names .* not a file of its own folder") as e:
        load(inspect_teacher(tiny_path), data_cfg(dataset=str(folder)), tmp_path / "cache")
    assert "\n" not in str(e.value)


def damage_dataset(tmp_path, damage):
    if damage == "none_caption":
        return saved_dataset(tmp_path, {"image": images(), "caption": [CAPTIONS[0], None, CAPTIONS[2]]})
    if damage == "image_strings":
        features = datasets.Features({"image": datasets.Value("string"), "caption": datasets.Value("string")})
        return saved_dataset(tmp_path, {"image": ["a.png"] * 3, "caption": CAPTIONS}, features)
    if damage == "empty":
        return saved_dataset(tmp_path, {"image": [], "caption": []}, dict_=False)
    if damage == "number_text":
        features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("int64")})
        return saved_dataset(tmp_path, {"image": images(), "caption": [1, 2, 3]}, features)
    folder = saved_dataset(tmp_path)
    if damage == "no_splits":
        (folder / "dataset_dict.json").write_text('{"splits": []}')
    elif damage == "garbage_json":
        (folder / "train" / "state.json").write_text("{not json")
    elif damage == "truncated_arrow":
        arrow = next((folder / "train").glob("*.arrow"))
        arrow.write_bytes(arrow.read_bytes()[:100])
    return folder


@pytest.mark.parametrize(
    "damage, message",
    [
        ("none_caption", "some rows have an empty caption"),
        ("image_strings", "has no image column"),
        ("number_text", "has no text column"),
        ("no_splits", "a dataset dict with no splits"),
        ("garbage_json", "train/state.json is not valid JSON"),
        ("truncated_arrow", "cannot be read as a datasets folder"),
        ("empty", "state.json lists no data files"),
    ],
)
def test_a_damaged_dataset_is_one_line(tiny_path, tmp_path, damage, message):
    folder = damage_dataset(tmp_path, damage)
    with pytest.raises(UserError, match=message) as e:
        load(inspect_teacher(tiny_path), data_cfg(dataset=str(folder)), tmp_path / "cache")
    assert "\n" not in str(e.value) and "data.dataset=" in str(e.value)


@pytest.mark.parametrize("damage", ["latin1_txt", "number_jsonl"])
def test_captions_that_are_not_text_are_one_line(tiny_path, tmp_path, damage):
    root = write_folder(tmp_path / "images", jsonl=damage == "number_jsonl")
    if damage == "latin1_txt":
        (root / "img1.txt").write_bytes("caf\xe9".encode("latin-1"))
    else:
        (root / "captions.jsonl").write_text(
            "\n".join(json.dumps({"file_name": f"img{i}.png", "text": i}) for i in range(3))
        )
    with pytest.raises(UserError, match="not UTF-8|not a JSON object with file_name and text"):
        load(inspect_teacher(tiny_path), data_cfg(root=str(root)), tmp_path / "cache")


def test_16_bit_greyscale_and_exif_orientation_are_read_as_seen():
    grey = np.full((16, 16), 32768, dtype=np.uint16)  # mid-grey in 16 bits, not white
    pixels = to_pixels(Image.fromarray(grey), 16, 16)
    assert abs(float(pixels.mean())) < 0.05
    wide = Image.fromarray(np.concatenate([np.zeros((8, 8, 3)), np.full((8, 8, 3), 255)], 1).astype(np.uint8))
    exif = wide.getexif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display": shown 8 wide and 16 tall, black above white
    rotated = Image.open(__import__("io").BytesIO(_save_jpeg(wide, exif)))
    shown = to_pixels(rotated, 16, 8)
    assert shown.shape == (3, 16, 8)
    assert float(shown[:, :8].mean()) < 0 < float(shown[:, 8:].mean())  # black on top, white below


def _save_jpeg(image, exif) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, "JPEG", exif=exif, quality=95)
    return buf.getvalue()


def linked(root, damage):
    """A folder of captioned images with one link a walk would skip unread."""
    if damage == "broken_image":
        (root / "gone.png").symlink_to(root / "moved.png")
    elif damage == "broken_jsonl":  # without it the .txt captions would be read instead, silently
        (root / "captions.jsonl").symlink_to(root / "elsewhere.jsonl")
    elif damage == "broken_caption":
        (root / "img1.txt").unlink()
        (root / "img1.txt").symlink_to(root / "moved.txt")
    elif damage == "linked_folder":
        write_folder(root.parent / "more")
        (root / "more").symlink_to(root.parent / "more", target_is_directory=True)


@pytest.mark.parametrize(
    "damage,message",
    [
        ("broken_image", "gone.png is a broken link (to '{root}/moved.png'); point it at the file or remove it"),
        ("broken_jsonl", "captions.jsonl is a broken link (to '{root}/elsewhere.jsonl'); point it at the file or"),
        ("broken_caption", "img1.png has no caption (img1.txt beside it is a broken link (to '{root}/moved.txt'))"),
        ("linked_folder", "more is a link to a folder, which is not followed; copy or move its files into data.root"),
    ],
)
def test_a_link_a_walk_would_skip_is_one_line_naming_it(tmp_path, damage, message):
    root = write_folder(tmp_path / "images")
    folder_source(str(root))
    linked(root, damage)
    with refused(f"data.root='{root}': " + message.format(root=root)) as e:
        folder_source(str(root))
    assert "\n" not in str(e.value)


def test_a_subfolder_it_may_not_list_is_left_out_with_a_warning_and_an_unlistable_root_is_one_line(
    tmp_path, monkeypatch, caplog
):
    """data.root on a disk's mount point holds lost+found, which only root lists: its images (none) are left out,
    said in a warning, not a refusal no one can act on; data.root itself unlistable is refused."""
    root = write_folder(tmp_path / "images")
    (root / "lost+found").mkdir()
    (root / "sub").mkdir()
    (root / "sub" / "captions.jsonl").symlink_to(root / "gone.jsonl")  # not the one it reads: no matter
    scandir, shut = os.scandir, {str(root / "lost+found")}

    def guarded(path="."):
        if str(path) in shut:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", guarded)
    with caplog.at_level(logging.WARNING):
        assert folder_source(str(root)).captions == CAPTIONS
    assert [r.getMessage() for r in caplog.records] == [
        f"data.root='{root}': lost+found cannot be listed (Permission denied); its files, if any, are left out"
    ]
    shut.add(str(root))
    with refused(f"data.root='{root}': the folder cannot be listed (Permission denied); make it readable"):
        folder_source(str(root))


def test_a_captions_jsonl_naming_files_the_folder_lacks_is_one_line(tmp_path):
    root = write_folder(tmp_path / "images", jsonl=True)
    lines = (root / "captions.jsonl").read_text()
    extra = [{"file_name": "img9.png", "text": "a moved image"}, {"file_name": "x/img8.jpg", "text": "a typo"}]
    (root / "captions.jsonl").write_text(lines + "".join("\n" + json.dumps(row) for row in extra))
    with refused("captions.jsonl names 2 file(s) not in the folder, the first 'img9.png' (file_name is relative to"):
        folder_source(str(root))
    # There, but not an image it reads: its caption would train on nothing.
    (root / "captions.jsonl").write_text(lines + "\n" + json.dumps({"file_name": "notes.md", "text": "notes"}))
    (root / "notes.md").write_text("# notes")
    with refused("captions.jsonl names 1 file(s) that are not images it reads, the first 'notes.md'; convert them"):
        folder_source(str(root))


def test_a_file_captioned_twice_in_captions_jsonl_is_one_line_and_dot_slash_names_the_same_file(tmp_path):
    root = write_folder(tmp_path / "images", jsonl=True)
    lines = (root / "captions.jsonl").read_text()
    (root / "captions.jsonl").write_text(lines + "\n" + json.dumps({"file_name": "./img1.png", "text": "another"}))
    with refused("captions.jsonl captions 'img1.png' twice (lines 2 and 4), and only one would be trained on; keep"):
        folder_source(str(root))
    (root / "captions.jsonl").write_text(lines.replace('"img0.png"', '"./img0.png"'))
    assert folder_source(str(root)).captions == CAPTIONS  # ./img0.png is img0.png
    (root / "sub").mkdir()
    (root / "img2.png").rename(root / "sub" / "img2.png")
    (root / "captions.jsonl").write_text(lines.replace('"img2.png"', '"sub\\\\img2.png"'))  # written on Windows
    assert folder_source(str(root)).captions == CAPTIONS  # sub\img2.png is sub/img2.png


def test_txt_captions_beside_a_captions_jsonl_are_said_to_be_unread(tmp_path, caplog):
    root = write_folder(tmp_path / "images", jsonl=True)
    with caplog.at_level(logging.WARNING):
        folder_source(str(root))
    assert not caplog.records  # one set of captions: nothing to say
    for i in range(2):
        (root / f"img{i}.txt").write_text("another caption")
    with caplog.at_level(logging.WARNING):
        assert folder_source(str(root)).captions == CAPTIONS  # captions.jsonl's, as before
        folder_source(str(root))  # read again in the same run: said once
    (line,) = [r.getMessage() for r in caplog.records]
    assert "captions.jsonl captions the images; the 2 .txt caption(s) beside them are not read" in line


def test_a_blank_caption_line_a_broken_link_to_a_folder_and_a_one_frame_gif_are_each_one_line(tmp_path):
    root = write_folder(tmp_path / "images", jsonl=True)
    lines = (root / "captions.jsonl").read_text()
    for text in ("", "   "):  # a blank line trained img0 on an empty prompt; "" said it had no line
        (root / "captions.jsonl").write_text(lines.replace(CAPTIONS[0], text))
        with refused("img0.png has no caption (its captions.jsonl line's text is empty); caption every image"):
            folder_source(str(root))
    (root / "captions.jsonl").write_text(lines)
    (root / "batch2").symlink_to(tmp_path / "gone", target_is_directory=True)  # a folder of images, since deleted
    with refused("batch2 is a broken link (to "):
        folder_source(str(root))
    (root / "batch2").unlink()
    (root / ".cache").symlink_to(tmp_path / "gone")  # hidden: not data
    images()[0].save(root / "still.gif")
    with refused("still.gif is a GIF of one frame, which data=image_folder does not read (.png, .jpg"):
        folder_source(str(root))


def test_the_folder_is_walked_once(tmp_path, monkeypatch):
    """One listing of each folder per source, what it finds reused (no images: the hint reads the same walk)."""
    root = write_folder(tmp_path / "images")
    write_folder(root / "sub")
    listed: list[str] = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(str(path)) or scandir(path))
    assert len(folder_source(str(root)).captions) == 6
    assert sorted(listed) == [str(root), str(root / "sub")]
    listed.clear()
    with refused("holds no videos (.gif, .webp, .mp4, .mov, .mkv, .webm, .avi, .m4v); it holds images: use data=im"):
        folder_videos(str(root))
    assert sorted(listed) == [str(root), str(root / "sub")]


def test_a_transparent_still_is_on_black_whatever_its_format_keeps_under_its_clear_pixels(tmp_path):
    """x0 (a text-to-video teacher's): a PNG keeps the colour under a clear pixel, a WebP's encoder drops it; each is
    composited onto black, as a clip's frames are (tests/data/test_videos.py)."""
    image = Image.new("RGBA", (16, 16), (200, 120, 40, 255))
    image.paste((200, 120, 40, 0), (0, 0, 16, 4))  # the top rows clear, their colour kept in the PNG
    for suffix in ("png", "webp"):
        image.save(tmp_path / f"still.{suffix}", lossless=True)
    png, webp = (to_pixels(Image.open(tmp_path / f"still.{s}"), 16, 16) for s in ("png", "webp"))
    assert torch.equal(png, webp) and (png[:, :4] == -1).all() and (png[:, 4:] > -1).all()


def test_a_captioned_file_it_does_not_read_is_one_line_and_a_caption_of_nothing_is_said(tmp_path, caplog):
    """a.tiff beside a.txt was dropped unread, its caption with it; a .txt beside no file (its image renamed or
    moved out) is said once, as a folder may hold notes."""
    root = write_folder(tmp_path / "images")
    images()[0].save(root / "img3.tiff")
    (root / "img3.txt").write_text("a fourth image")
    with refused("img3.tiff has a caption (img3.txt) but is not among the images it reads (.png, .jpg, .jpeg, .webp"):
        folder_source(str(root))
    (root / "img3.tiff").unlink()
    (root / "README.md").write_text("# my images")  # a note beside a note: not a picture dropped
    (root / "README.txt").write_text("see README.md")
    (root / "notes.txt").unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING):
        assert folder_source(str(root)).captions == CAPTIONS
        folder_source(str(root))  # read again in the same run: said once
    (line,) = [r.getMessage() for r in caplog.records]
    assert (
        "2 .txt file(s) caption no image in the folder, the first 'README.txt' (is its image renamed or moved" in line
    )


def test_a_named_pipe_named_as_an_image_is_one_line_not_a_skip_or_a_hang(tmp_path):
    root = write_folder(tmp_path / "images")
    os.mkfifo(root / "img3.png")  # opened, it would wait for a writer forever
    with refused(f"data.root='{root}': img3.png is not a regular file (a pipe, socket or device); put the file"):
        folder_source(str(root))
    (root / "img3.png").unlink()
    (root / "img3.png").symlink_to("/dev/null")  # a link to a device: not a broken link
    with refused("img3.png is not a regular file"):
        folder_source(str(root))
    (root / "img3.png").unlink()
    (root / "img2.txt").unlink()
    os.mkfifo(root / "img2.txt")  # a caption that is a pipe: there, not "no img2.txt beside it"
    with refused("img2.png has no caption (img2.txt beside it is not a regular file (a pipe, socket or device))"):
        folder_source(str(root))


def test_a_float_image_in_a_dataset_is_refused_not_trained_on_as_black(tiny_path, tmp_path):
    # A review's: a mode-F image of 0..1 became an all-black still (a first frame of one was refused already).
    floats = [Image.fromarray(np.full((80, 100), 0.5, dtype=np.float32)) for _ in CAPTIONS]
    folder = saved_dataset(tmp_path, {"image": floats, "caption": CAPTIONS})
    with pytest.raises(UserError, match=r"data.dataset=.* holds floating-point pixels \(mode F\)"):
        load(inspect_teacher(tiny_path), data_cfg(dataset=str(folder)), tmp_path / "cache")
