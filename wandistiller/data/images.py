"""Real images as x0: a captioned image folder or a local Hugging Face `datasets` folder, encoded once
with the teacher's own VAE into a cached LatentBank; captions through the teacher's text encoder.

A folder holds images with a caption each: `name.txt` beside `name.png`, or one `captions.jsonl` of
{"file_name": ..., "text": ...} lines (the `datasets` imagefolder convention; "file"/"image" and
"caption"/"prompt" are read too). A dataset is whatever `datasets.load_from_disk` reads, offline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from wandistiller.core.errors import UserError
from wandistiller.core.tensor_files import file_stamps
from wandistiller.data.conditions import PIXELS, check_given, fitted, frame_size, image_bank, rgb, unreadable
from wandistiller.data.latents import LatentBank, cached_bank
from wandistiller.data.prompts import PromptEmbeddings, encode_prompts
from wandistiller.teacher.spec import TeacherSpec
from wandistiller.teacher.vae import encode_images, load_vae

log = logging.getLogger(__name__)
_SAID: set[str] = set()  # folders whose unread .txt captions were said, once a process (a run reads them often)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# A video folder's files (data/videos.py reads them): GIF and WebP through PIL (animated), the rest through PyAV.
PIL_SUFFIXES = (".gif", ".webp")
AV_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v")
VIDEO_SUFFIXES = PIL_SUFFIXES + AV_SUFFIXES
MEDIA_SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES
# Pictures and clips in formats a folder source does not read: one captioned beside its .txt is refused (dropped
# unread, its caption with it); any other file beside a .txt (README.md, a trainer's .npz cache) is not a picture.
UNREAD_MEDIA = (
    ".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl", ".jp2", ".j2k", ".ppm", ".pgm", ".pbm", ".tga", ".dng",
    ".cr2", ".cr3", ".nef", ".arw", ".raw", ".exr", ".hdr", ".psd", ".svg", ".ico", ".jfif", ".mpg", ".mpeg",
    ".wmv", ".flv", ".3gp", ".ts", ".mts", ".m2ts", ".ogv", ".vob", ".mxf", ".dv", ".y4m", ".f4v", ".hevc", ".h264",
)  # fmt: skip
FILE_KEYS, TEXT_KEYS = ("file_name", "file", "image"), ("text", "caption", "prompt")


@dataclass
class ImageSource:
    """Captions, a way to open image i, what the user called it (for errors) and a fingerprint (for the cache)."""

    captions: list[str]
    image: Callable[[int], Image.Image]  # image i, opened (not named `open`: the guard test reads that as a file)
    key: str
    fingerprint: str
    files: list[str] | None = None  # a folder's images by their names in it (for errors); a dataset's are rows


def _jsonl_captions(path: Path, key: str) -> dict[str, str]:
    """file name (relative to the folder; `./`, `a/../` and Windows' `\\` spelled out) -> its caption, one line
    each: a line that is not one, or a second line for a file (only one would be trained on), refused in one line."""
    captions: dict[str, str] = {}
    lines: dict[str, int] = {}
    for n, line in enumerate(_text(path, key).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name = next(row[k] for k in FILE_KEYS if k in row)
            caption = next(row[k] for k in TEXT_KEYS if k in row)
            if not isinstance(caption, str) or not isinstance(name, str):
                raise TypeError
        except (json.JSONDecodeError, StopIteration, TypeError):
            raise UserError(
                f"{key}: {path.name} line {n} is not a JSON object with file_name and text; "
                'write one {"file_name": "a.png", "text": "a caption"} per line'
            ) from None
        name = posixpath.normpath(name.replace("\\", "/"))  # a list written on Windows names sub\\a.png
        if name in lines:
            raise UserError(
                f"{key}: {path.name} captions {name!r} twice (lines {lines[name]} and {n}), and only one would be "
                "trained on; keep one line per file"
            )
        captions[name], lines[name] = caption, n
    return captions


def _text(path: Path, key: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{key}: {path.name} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def captioned_files(
    root: str, suffixes: tuple[str, ...], what: str, other=None
) -> tuple[Path, str, list[Path], list[Path]]:
    """(the folder, its key for errors, its files with one of `suffixes`, every file in it; each sorted) of
    `data.root`, from one walk, refused in one line where it is not a folder or holds none; `what` names them
    ("images", "videos"); `other`: (the other kind's suffixes, its name, the data option that reads them), named
    where the folder holds those instead. The callers check the rest of the folder on `every file`."""
    path, key = Path(root).expanduser(), f"data.root={root!r}"
    if not path.is_dir():
        raise UserError(f"{key} is not a folder; give a folder of {what} with captions")
    every = _folder_files(path, key)
    files = [p for p in every if p.suffix.lower() in suffixes]
    if not files:
        holds_other = other is not None and any(p.suffix.lower() in other[0] for p in every)
        hint = f"; it holds {other[1]}: use {other[2]}" if holds_other else f"; give a folder of captioned {what}"
        raise UserError(f"{key} holds no {what} ({', '.join(suffixes)}){hint}")
    return path, key, files, every


def first_only(files: list[Path], kind: tuple[str, ...], other: tuple[str, ...]) -> Path | None:
    """The first of `files` that is of `kind` alone (by suffix; a WebP is both a still and a clip), else None: a
    clip among an image folder's stills, or a still among a video folder's clips."""
    return next((p for p in files if p.suffix.lower() in kind and p.suffix.lower() not in other), None)


def _folder_files(path: Path, key: str) -> list[Path]:
    """Every file under `path`, sorted, in one walk. What the walk would skip unread is refused in one line: a
    broken link named as a file a folder source reads (an image, a video, captions.jsonl), a link to a folder (not
    followed: it could lead anywhere, itself included); a subfolder that cannot be listed is left out with a
    warning (a disk's lost+found), data.root itself refused."""

    def unlisted(error: OSError) -> None:
        rel = Path(error.filename).relative_to(path).as_posix() if error.filename else "."
        if rel == ".":
            raise UserError(f"{key}: the folder cannot be listed ({error.strerror}); make it readable")
        # A subfolder it may not read (a disk's lost+found, another user's): said, and its files left out.
        log.warning("%s: %s cannot be listed (%s); its files, if any, are left out", key, rel, error.strerror)

    files = []
    for folder, dirs, names in os.walk(path, onerror=unlisted):
        here = Path(folder)
        for name in dirs:
            if (here / name).is_symlink():
                raise UserError(
                    f"{key}: {(here / name).relative_to(path).as_posix()} is a link to a folder, which is not "
                    "followed; copy or move its files into data.root, or give that folder as data.root"
                )
        for name in names:
            file = here / name
            read = file.suffix.lower() in MEDIA_SUFFIXES or file == path / "captions.jsonl"
            if file.is_file():
                files.append(file)
            elif file.is_symlink() and not file.exists() and (read or (not file.suffix and not name.startswith("."))):
                # an image, a clip, the captions it reads, or what may have been a folder of them
                raise UserError(
                    f"{key}: {file.relative_to(path).as_posix()} is a broken link (to {os.readlink(file)!r}); "
                    "point it at the file or remove it"
                )
            elif read:  # a named pipe, socket or device: skipped, it was dropped; opened, a pipe waits forever
                raise UserError(
                    f"{key}: {file.relative_to(path).as_posix()} is not a regular file (a pipe, socket or device); "
                    "put the file itself there or remove it"
                )
    return sorted(files)


def captions_of(path: Path, key: str, files: list[Path], what: str, every: list[Path]) -> tuple[list[str], str]:
    """(each file's caption: captions.jsonl's line, else the .txt beside it; a fingerprint of the files and
    captions, for the cache), a file without one refused in one line, as is a captions.jsonl naming files that
    are not among them (`every`: all of the folder's files, from the same walk)."""
    jsonl = path / "captions.jsonl"
    from_jsonl = _jsonl_captions(jsonl, key) if jsonl.is_file() else None
    if from_jsonl is not None:
        _check_jsonl(from_jsonl, path, key, files, what, every)
    else:
        _check_txt(path, key, files, what, every)
    captions = []
    for file in files:
        rel = file.relative_to(path).as_posix()
        txt = file.with_suffix(".txt")
        if from_jsonl is not None:
            caption = from_jsonl.get(rel)
            caption = caption.strip() if caption is not None else None  # blank is none, as a .txt's is
        else:
            caption = _text(txt, key).strip() if txt.is_file() else None
        if not caption:
            where = (
                "its captions.jsonl line's text is empty"
                if from_jsonl is not None and rel in from_jsonl
                else "captions.jsonl has no line for it"
                if from_jsonl is not None
                else f"{txt.name} beside it is empty"
                if txt.is_file()
                else f"{txt.name} beside it is a broken link (to {os.readlink(txt)!r})"
                if txt.is_symlink() and not txt.exists()
                else f"{txt.name} beside it is not a regular file (a pipe, socket or device)"
                if txt.exists()
                else f"no {txt.name} beside it"
            )
            raise UserError(f"{key}: {rel} has no caption ({where}); caption every {what}")
        captions.append(caption)
    stats = [(p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return captions, hashlib.sha256(json.dumps([str(path.resolve()), stats, captions]).encode()).hexdigest()


def _check_jsonl(
    captions: dict[str, str], path: Path, key: str, files: list[Path], what: str, every: list[Path]
) -> None:
    """captions.jsonl captions files of the folder only, each one it reads: a line for a file that is not there (a
    typo, a file moved out) or that is not one of its `what`s would be a caption trained on nothing. The .txt
    captions beside them, which it is read instead of, are said (once a process)."""
    read = {p.relative_to(path).as_posix() for p in files}
    present = {p.relative_to(path).as_posix() for p in every}
    missing = [name for name in captions if name not in present]
    if missing:
        raise UserError(
            f"{key}: captions.jsonl names {len(missing)} file(s) not in the folder, the first {missing[0]!r} "
            "(file_name is relative to data.root); add the files or remove their lines"
        )
    unread = [name for name in captions if name not in read]
    if unread:
        raise UserError(
            f"{key}: captions.jsonl names {len(unread)} file(s) that are not {what}s it reads, the first "
            f"{unread[0]!r}; convert them or remove their lines"
        )
    beside = sum(1 for name in read if posixpath.splitext(name)[0] + ".txt" in present)
    if beside and key not in _SAID:  # two sets of captions: which one trains is said, not guessed
        _SAID.add(key)
        log.warning(
            "%s: captions.jsonl captions the %ss; the %d .txt caption(s) beside them are not read (remove "
            "captions.jsonl to train on those)",
            key,
            what,
            beside,
        )


def _check_txt(path: Path, key: str, files: list[Path], what: str, every: list[Path]) -> None:
    """Each .txt caption captions a file it reads: one beside a file in a format it does not read (a.tiff, a.heic
    beside a.txt) is refused, since that captioned file was dropped unread; one beside no file at all (its file
    renamed or moved out) is said, once a process (a folder may hold notes)."""
    read = set(files)
    stems: dict[Path, list[Path]] = {}
    for file in every:
        if file.suffix != ".txt":
            stems.setdefault(file.with_suffix(""), []).append(file)
    alone = []
    for txt in (file for file in every if file.suffix == ".txt"):
        others = stems.get(txt.with_suffix(""), [])
        if any(other in read for other in others):
            continue
        others = [other for other in others if other.suffix.lower() in UNREAD_MEDIA]  # README.md: a note's
        if others:
            suffixes = IMAGE_SUFFIXES if what == "image" else VIDEO_SUFFIXES
            raise UserError(
                f"{key}: {others[0].relative_to(path).as_posix()} has a caption ({txt.name}) but is not among the "
                f"{what}s it reads ({', '.join(suffixes)}); convert it to one of those, or remove it and its caption"
            )
        alone.append(txt.relative_to(path).as_posix())
    if alone and f"{key} alone" not in _SAID:
        _SAID.add(f"{key} alone")
        log.warning(
            "%s: %d .txt file(s) caption no %s in the folder, the first %r (is its %s renamed or moved out?); they "
            "are not read",
            key,
            len(alone),
            what,
            alone[0],
            what,
        )


def _one_frame_gif(file: Path) -> bool:
    """Whether `file` is a GIF holding a single frame (a still in a format the image folder does not read)."""
    if file.suffix.lower() != ".gif":
        return False
    try:
        with Image.open(file) as opened:
            return getattr(opened, "n_frames", 1) == 1
    except Exception:  # unreadable: named as what its name says
        return False


def folder_source(root: str) -> ImageSource:
    path, key, images, every = captioned_files(
        root, IMAGE_SUFFIXES, "images", (VIDEO_SUFFIXES, "videos", "data=video_folder")
    )
    # A clip among the images would be dropped (a GIF, a video) or read as its first frame (an animated WebP):
    # named, not trained on silently.
    clip = first_only(every, VIDEO_SUFFIXES, IMAGE_SUFFIXES)
    if clip is not None and _one_frame_gif(clip):
        raise UserError(
            f"{key}: {clip.relative_to(path).as_posix()} is a GIF of one frame, which data=image_folder does not "
            f"read ({', '.join(IMAGE_SUFFIXES)}); save it as a PNG, or move it out of the folder"
        )
    if clip is not None:
        raise UserError(
            f"{key}: {clip.relative_to(path).as_posix()} is a video, and data=image_folder takes stills; for clips "
            "use data=video_folder, or move it out of the folder"
        )
    captions, fingerprint = captions_of(path, key, images, "image", every)
    for image in images:  # headers only: an unreadable image is named now, not after the encoder loads
        try:
            with Image.open(image) as opened:
                frames = getattr(opened, "n_frames", 1)
                opened.verify()
        except Exception as e:  # PIL raises many types for a damaged file; all mean the same to the user
            why = unreadable(e)
            fix = "" if why.endswith("scale it down") else "; replace or remove it"
            raise UserError(f"{key}: {image.relative_to(path).as_posix()} {why}{fix}") from None
        if frames > 1:
            raise UserError(
                f"{key}: {image.relative_to(path).as_posix()} is animated ({frames} frames), and data=image_folder "
                "takes stills; for clips use data=video_folder, or save its first frame alone"
            )
    names = [image.relative_to(path).as_posix() for image in images]
    return ImageSource(captions, lambda i: Image.open(images[i]), key, fingerprint, names)


def _pick_column(features: dict, wanted: str | None, kind: str, key: str, fits) -> str:
    if wanted is not None:
        if wanted not in features:
            raise UserError(f"{key} has no column {wanted!r} (data.{kind}_column); it has {sorted(features)}")
        return wanted
    found = [name for name, feature in features.items() if fits(name, feature)]
    if not found:
        raise UserError(f"{key} has no {kind} column (it has {sorted(features)}); set data.{kind}_column")
    return found[0]


def dataset_source(dataset: str, image_column: str | None = None, text_column: str | None = None) -> ImageSource:
    import datasets

    key, folder = f"data.dataset={dataset!r}", Path(dataset).expanduser()
    if not folder.is_dir():
        raise UserError(f"{key} is not a folder written by datasets' save_to_disk; give the folder it wrote")
    _dataset_files_inside(folder, key)
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # no state.json, garbage JSON, truncated arrow files: datasets raises many types
        raise UserError(f"{key} cannot be read as a datasets folder ({type(e).__name__}); save it again") from None
    if isinstance(ds, datasets.DatasetDict):
        if not ds:
            raise UserError(f"{key} is a dataset dict with no splits; save one with a train split")
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    is_image = lambda f: isinstance(f, datasets.Image)
    image_col = _pick_column(ds.features, image_column, "image", key, lambda n, f: is_image(f))
    text_col = _pick_column(
        ds.features, text_column, "text", key, lambda n, f: n in TEXT_KEYS and getattr(f, "dtype", None) == "string"
    )
    if not is_image(ds.features[image_col]):
        raise UserError(
            f"{key}: column {image_col!r} holds {ds.features[image_col]}, not images; set data.image_column"
        )
    if getattr(ds.features[text_col], "dtype", None) not in ("string", "large_string"):
        raise UserError(f"{key}: column {text_col!r} holds {ds.features[text_col]}, not text; set data.text_column")
    captions = [c.strip() if isinstance(c, str) else "" for c in ds[text_col]]  # None is no caption, not "None"
    if len(ds) == 0 or not all(captions):
        raise UserError(f"{key}: {'no rows' if len(ds) == 0 else 'some rows have an empty ' + text_col}")
    fingerprint = hashlib.sha256(json.dumps([dataset, ds._fingerprint, len(ds)]).encode()).hexdigest()
    return ImageSource(captions, lambda i: ds[i][image_col], key, fingerprint)


def _dataset_files_inside(folder: Path, key: str) -> None:
    """A datasets folder names its own files (state.json's `_data_files`, dataset_dict.json's splits), and
    load_from_disk opens them as named: a received folder naming `../x` or `/abs/x` would read outside it."""
    names: list[tuple[str, object]] = []
    for meta, field in [("dataset_dict.json", "splits"), ("state.json", "_data_files")]:
        for file in [folder / meta, *folder.glob(f"*/{meta}")]:
            if not file.is_file():
                continue
            try:
                entries = json.loads(file.read_text(encoding="utf-8")).get(field, [])
            except (ValueError, OSError, AttributeError):  # garbage, not UTF-8, not an object
                raise UserError(
                    f"{key}: {file.relative_to(folder)} is not valid JSON; save the dataset again"
                ) from None
            rel = file.relative_to(folder).as_posix()
            if meta == "state.json" and not entries:  # datasets then fails with an IndexError
                raise UserError(f"{key}: {rel} lists no data files (an empty dataset); save one with rows")
            names += [(rel, e.get("filename") if isinstance(e, dict) else e) for e in entries or []]
    for where, name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise UserError(
                f"{key}: {where} names {name!r}, not a file of its own folder; a dataset may read only its own files"
            )


def to_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """Upright (EXIF orientation), resized to cover (height, width), center-cropped, scaled to [-1, 1]: [3, H, W]."""
    return _upright_pixels(ImageOps.exif_transpose(image), height, width)


def _upright_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """`to_pixels` of an image already upright (exif_transpose copies even an image it leaves as it is)."""
    fitted = ImageOps.fit(rgb(image), (width, height), method=Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(fitted, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)


def _pixels(source: ImageSource, i: int, height: int, width: int, small: list[str]) -> torch.Tensor:
    """Image i's pixels; its name added to `small` where it is scaled up to cover the frame (blurred)."""
    try:
        image = ImageOps.exif_transpose(source.image(i))  # upright: its size as the frame sees it
        if image.mode == "F":  # a saved dataset's float image: 0..1 became a black still (data.root takes no TIFF)
            raise UserError(
                f"{source.key}: {_name(source, i)} holds floating-point pixels (mode F), whose range is unknown; "
                "save it as an 8- or 16-bit image"
            )
        if image.width < width or image.height < height:
            small.append(_name(source, i))
        return _upright_pixels(image, height, width)
    except (OSError, ValueError, SyntaxError) as e:  # what PIL raises on a corrupt or truncated file
        raise UserError(f"{source.key}: {_name(source, i)} is unreadable ({e}); replace or remove it") from None


def stills_only(frames: int) -> str:
    """Why a text-to-video teacher's image data takes one latent frame, and what to give instead."""
    return (
        f"data.latent_frames={frames} with images and a text-to-video teacher: its images are one-frame latents "
        "(stills); give an image-to-video teacher (it takes each image as a clip's first frame), or "
        "data.latent_frames=1 to train on stills"
    )


def image_latents(
    spec: TeacherSpec,
    source: ImageSource,
    latent_shape: tuple[int, int, int, int],
    cache_dir: str | os.PathLike,
    device: torch.device,
    chunk_size: int = 16,
    progress: bool = True,
) -> LatentBank:
    """The images as normalised VAE latents of `latent_shape` (one frame), cached and resumable by chunk."""
    _, frames, h, w = latent_shape
    if frames != 1:
        raise UserError(stills_only(frames))
    vae_files = file_stamps(spec.path / "vae", "*.safetensors")
    vae_id = [str(spec.path.resolve()), (spec.path / "vae" / "config.json").read_text(), vae_files]
    blob = json.dumps([vae_id, source.fingerprint, list(latent_shape), PIXELS])
    key = hashlib.sha256(blob.encode()).hexdigest()[:20]
    vae: list = []  # loaded only when a chunk is missing
    small: list[str] = []  # images scaled up to the frame: a text-to-video teacher's x0 takes them, blurred

    def make_chunk(items: range) -> torch.Tensor:
        if not vae:
            vae.append(load_vae(spec, device))
        scale = vae[0].config.scale_factor_spatial
        pixels = torch.stack([_pixels(source, i, h * scale, w * scale, small) for i in items])
        return encode_images(vae[0], pixels)

    folder = Path(cache_dir).expanduser() / "image_latents" / key
    bank = cached_bank(folder, len(source.captions), chunk_size, 1, make_chunk, "image latents", progress, latent_shape)
    if small:  # said as they are encoded (a cached bank is not opened again)
        log.warning(
            "%s: %d of the images encoded (%s%s) are smaller than the frame and were scaled up, so they train "
            "blurred; give larger images, or lower data.latent_height/latent_width",
            source.key, len(small), ", ".join(small[:3]), ", …" if len(small) > 3 else "",
        )  # fmt: skip
    return bank


def image_source(data_cfg) -> ImageSource:
    """The images and captions `data.root` or `data.dataset` names; refused in one line where they cannot
    serve (the preflight calls this before anything heavy)."""
    if data_cfg.root is not None and data_cfg.dataset is not None:  # an experiment's dataset and the user's folder
        raise UserError(
            f"data=image_folder: both data.root={data_cfg.root!r} and data.dataset={data_cfg.dataset!r} are set; keep "
            "one (data.dataset=null to train on the folder)"
        )
    if data_cfg.root is None and data_cfg.dataset is None:
        raise UserError("data=image_folder: set one of data.root (an image folder) or data.dataset (a datasets folder)")
    if data_cfg.root is not None:
        return folder_source(data_cfg.root)
    return dataset_source(data_cfg.dataset, data_cfg.image_column, data_cfg.text_column)


def image_data(spec: TeacherSpec, data_cfg, teacher_cfg, dtype, device, cache_dir, progress=True):
    """(caption embeddings, LatentBank) for `data.latents=images`: bank item i is image i, prompt i."""
    source = image_source(data_cfg)
    channels = spec.latent_channels  # x0's, not an I2V expert's input (noise + mask + image)
    shape = (channels, data_cfg.latent_frames, data_cfg.latent_height, data_cfg.latent_width)
    bank = image_latents(spec, source, shape, cache_dir, device, data_cfg.latent_chunk, progress)
    embeddings: PromptEmbeddings = encode_prompts(
        spec, source.captions, teacher_cfg.negative_prompt, teacher_cfg.max_sequence_length, dtype, device, cache_dir
    )
    return embeddings, bank


def image_pairs(spec: TeacherSpec, data_cfg, teacher_cfg, dtype, device, cache_dir, progress=True):
    """(caption embeddings, None, ImageBank) for an image-to-video teacher on `data.latents=images`: image i is
    prompt i's given first frame; x0 is Gaussian (the images are no clips), as on prompts alone."""
    source = image_source(data_cfg)
    opened, names = _given(source), lambda i: _name(source, i)
    count, key = len(source.captions), source.key
    images = image_bank(spec, opened, names, count, source.fingerprint, data_cfg, cache_dir, device, key, progress)
    embeddings: PromptEmbeddings = encode_prompts(
        spec, source.captions, teacher_cfg.negative_prompt, teacher_cfg.max_sequence_length, dtype, device, cache_dir
    )
    return embeddings, None, images


def held_out_images(data_cfg, vae_config: dict, held: int) -> list[Image.Image]:
    """The given first frames of the last `held` captions (the held-out ones, in `held_out_prompts`' order), fitted
    to the run's frame size as training fits its images: what an image-to-video run's evaluation continues."""
    source = image_source(data_cfg)
    height, width = frame_size(data_cfg, vae_config)
    opened, count = _given(source), len(source.captions)
    return [fitted(opened(i), height, width, _name(source, i), source.key) for i in range(count - held, count)]


def check_given_images(data_cfg, vae_config: dict) -> None:
    """Every image can be an image-to-video teacher's given first frame at the run's size (`check_given`): each
    decoded, before the run folder is claimed, so a bad one is one line and not a failure mid-encoding."""
    source = image_source(data_cfg)
    height, width = frame_size(data_cfg, vae_config)
    opened = _given(source)
    for i in range(len(source.captions)):
        check_given(ImageOps.exif_transpose(opened(i)), height, width, _name(source, i), source.key)


def _name(source: ImageSource, i: int) -> str:
    return source.files[i] if source.files else f"image {i} ({source.captions[i][:40]!r})"


def _given(source: ImageSource) -> Callable[[int], Image.Image]:
    """`i -> image i`, decoded: a truncated file is refused in one line where it is opened."""

    def opened(i: int) -> Image.Image:
        try:
            image = source.image(i)
            image.load()
            return image
        except (OSError, ValueError, SyntaxError) as e:  # what PIL raises on a corrupt or truncated file
            raise UserError(f"{source.key}: {_name(source, i)} is unreadable ({e}); replace or remove it") from None

    return opened
