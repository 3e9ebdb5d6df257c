"""`wandistiller.core.files`: folders that cannot be written, and the guard: a received folder's files read and written
only inside it, at any depth; called directly on tiny real files in a temporary folder."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from wandistiller.core.errors import UserError
from wandistiller.core.files import (
    OutsideRunFolder,
    appendable,
    check_tree,
    clean_run_leftovers,
    folder_problem,
    in_run,
    open_in,
    opened,
    read_in,
    read_json_in,
    replace_folder,
    run_folder,
    write_in_run,
)
from wandistiller.core.tensor_files import safetensors_problem
from wandistiller.state.received import load_json


def test_a_folder_that_can_be_made_has_no_problem_and_one_through_a_file_or_a_dead_link_has(tmp_path):
    assert folder_problem(tmp_path / "new" / "deeper") is None  # need not exist yet
    (tmp_path / "afile").write_text("x")
    assert folder_problem(tmp_path / "afile") == f"{tmp_path / 'afile'} is a file"
    assert folder_problem(tmp_path / "afile" / "run") == f"{tmp_path / 'afile' / 'run'} runs through " \
        f"{tmp_path / 'afile'}, which is a file"  # fmt: skip
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    assert folder_problem(tmp_path / "link" / "run") == f"{tmp_path / 'link'} is a broken symbolic link"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder without write permission")
def test_a_folder_without_write_permission_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        assert folder_problem(locked / "run") == f"{locked} cannot be written (no write permission)"
    finally:
        locked.chmod(0o755)


def test_a_read_only_folder_is_named_read_only(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                                                   capture_output=True).returncode == 0  # fmt: skip
    if not mounted:
        folder.chmod(0o555)
        if os.access(folder, os.W_OK):
            pytest.skip("neither a read-only mount nor a read-only folder can be made here")
    try:
        assert "cannot be written" in folder_problem(folder / "run")
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


# -- a run folder's own files: never a link out of it ----------------------------------------------------------
def victim(tmp_path):
    """A file of the user's outside the run folder, its bytes and mtime (what a crafted folder must not change)."""
    path = tmp_path / "home" / "victim.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"the user's own file\n")
    os.utime(path, ns=(10**18, 10**18))
    return path


def untouched(path) -> bool:
    return path.read_bytes() == b"the user's own file\n" and path.stat().st_mtime_ns == 10**18


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    return folder


def test_a_name_whose_link_leads_out_of_the_run_folder_is_refused_in_one_line(tmp_path, run):
    mine = victim(tmp_path)
    (run / "eval.json").symlink_to(mine)
    (run / "generated").symlink_to(mine.parent)
    (run / "dangling").symlink_to(tmp_path / "home" / "not_yet")  # a write would create it out there
    (run / "checkpoints" / "step_00000001").symlink_to(tmp_path / "home")
    for name in ("eval.json", "generated", "generated/x.png", "dangling", "checkpoints/step_00000001/state.json"):
        with pytest.raises(OutsideRunFolder, match="leads out of the run folder") as e:
            in_run(run, name)
        assert "\n" not in str(e.value) and "remove the link" in str(e.value)
    assert str(e.value).startswith(
        f"{run / 'checkpoints/step_00000001/state.json'} leads out of the run folder "
        f"({run / 'checkpoints/step_00000001'} is a symbolic link to {tmp_path / 'home'})"
    )
    assert untouched(mine) and not (tmp_path / "home" / "not_yet").exists()


def test_links_inside_the_run_folder_and_absolute_names_inside_it_are_fine(run):
    (run / "checkpoints" / "step_00000002").mkdir()
    (run / "checkpoints" / "latest").symlink_to("step_00000002")
    assert in_run(run, "checkpoints/latest/state.json") == run / "checkpoints/latest/state.json"
    assert in_run(run, run / "eval.json") == run / "eval.json"  # not there yet: fine
    assert in_run(run, ".") == run
    (run.parent / "alias").symlink_to(run)  # the run folder itself reached through a link
    assert in_run(run.parent / "alias", "checkpoints") == run.parent / "alias" / "checkpoints"


def test_a_file_written_whole_replaces_a_link_in_its_place_and_never_writes_through_it(tmp_path, run):
    mine = victim(tmp_path)
    (run / "eval.json").symlink_to(mine)
    os.link(mine, run / "eval.png")  # a hard link: writing into it would change the victim too
    write_in_run(run, "eval.json", "{}")
    write_in_run(run, "eval.png", write=lambda f: f.write(b"png"))
    assert not (run / "eval.json").is_symlink() and (run / "eval.json").read_text() == "{}"
    assert (run / "eval.png").read_bytes() == b"png" and untouched(mine)
    (run / "out").symlink_to(mine.parent)
    with pytest.raises(OutsideRunFolder):  # its folder leads out: refused before anything is written
        write_in_run(run, "out/eval.json", "{}")
    assert sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"] and untouched(mine)


def test_a_file_appended_to_must_be_the_run_folders_own(tmp_path, run):
    mine = victim(tmp_path)
    (run / "metrics_steps.jsonl").symlink_to(mine)
    with pytest.raises(OutsideRunFolder, match="leads out of the run folder"):
        appendable(run, "metrics_steps.jsonl")
    (run / "metrics_steps.jsonl").unlink()
    os.link(mine, run / "train.log")
    with pytest.raises(OutsideRunFolder, match=r"train.log is a hard link \(2 names for one file\)"):
        appendable(run, "train.log")
    (run / "metrics.csv").write_text("step\n")
    assert appendable(run, "metrics.csv") == run / "metrics.csv" and appendable(run, "new.log") == run / "new.log"
    assert untouched(mine)


def test_a_folder_added_into_is_made_inside_the_run_folder_or_refused(tmp_path, run):
    mine = victim(tmp_path)
    assert run_folder(run, "tensorboard").is_dir()
    (run / "wandb").symlink_to(mine.parent)
    with pytest.raises(OutsideRunFolder):
        run_folder(run, "wandb/offline-run")
    assert sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"]


def test_a_folder_written_whole_replaces_a_link_or_hard_links_and_leaves_no_temporary(tmp_path, run):
    mine = victim(tmp_path)
    (run / "student").symlink_to(mine.parent)
    replace_folder(run, "student", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert not (run / "student").is_symlink() and (run / "student" / "config.json").read_text() == "{}"
    os.link(mine, run / "student" / "weights.safetensors")  # a hard-linked weights file inside it
    replace_folder(run, "student", lambda tmp: (tmp / "weights.safetensors").write_bytes(b"new"))
    assert (run / "student" / "weights.safetensors").read_bytes() == b"new" and untouched(mine)
    assert sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"]
    with pytest.raises(RuntimeError):  # a writer that fails leaves the old folder as it was, and no temporary
        replace_folder(run, "student", lambda tmp: (_ for _ in ()).throw(RuntimeError("boom")))
    assert (run / "student" / "weights.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "student"]


def test_a_killed_folder_swap_is_cleaned_up_on_the_next_start(run):
    (run / ".old-pipeline-x").mkdir()  # not our name pattern (no host-pid): left alone
    from wandistiller.core import leftovers

    dead = run / f".tmp-student-{leftovers.HOST}-99999999"  # a pid that cannot be alive
    dead.mkdir()
    clean_run_leftovers(run)
    assert not dead.exists() and (run / ".old-pipeline-x").exists()


def test_a_relative_run_folder_and_a_name_built_from_it_are_checked_where_they_are(tmp_path, monkeypatch):
    from tests.core.test_files import victim as make_victim

    mine = make_victim(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "run").mkdir(parents=True)
    root = Path("outputs/run")  # as a user types it: `python -m wandistiller.eval outputs/run`
    (root / "student").symlink_to(mine.parent)
    with pytest.raises(OutsideRunFolder):
        in_run(root, root / "student")  # not outputs/run/outputs/run/student, which does not exist
    assert write_in_run(root, root / "eval.json", "{}") == root / "eval.json" and (root / "eval.json").is_file()


# -- the guarded opener, at every depth (issue 33) ----------------------------------------------------------------
# A received folder's file at depth 1 to 4, linked out of the folder four ways; every reader refuses it in one line,
# leaves the user's file as it was and holds no descriptor of it; every writer replaces the link or refuses.
NAMES = ["metrics.json", "student/config.json", "checkpoints/step_00000001/state.json", "a/b/c/d.json"]
LINKS = ["absolute", "relative", "folder", "chain"]  # the name (two ways), a folder on its way, via a link inside


def descriptors_of(path: Path) -> list[str]:
    """This process's open descriptors that reach `path` (/proc/self/fd): a read must leave none, and never read."""
    real = os.path.realpath(path)
    fds = os.listdir("/proc/self/fd")
    return [fd for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == real]


def hostile(tmp_path: Path, name: str, link: str) -> tuple[Path, Path]:
    """(run folder, the user's file) with `name` in the folder leading out to that file by `link`."""
    root, mine = tmp_path / "run", victim(tmp_path)
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if link == "absolute":
        path.symlink_to(mine)
    elif link == "relative":
        path.symlink_to(os.path.relpath(mine, path.parent))
    elif link == "chain":
        (root / ".inside").symlink_to(mine)
        path.symlink_to(os.path.relpath(root / ".inside", path.parent))
    else:  # the first folder on the way is a link to a folder of the user's holding the rest of the name
        first, rest = Path(name).parts[0], Path(*Path(name).parts[1:])
        shutil.rmtree(root / first)
        outside = mine.parent / "theirs"
        (outside / rest).parent.mkdir(parents=True, exist_ok=True)
        os.link(mine, outside / rest)  # the user's file itself, under the name the tool opens
        (root / first).symlink_to(outside)
    return root, mine


def _read_through_opened(root, name):
    with opened(root, name) as path, open(path, "rb") as f:
        return f.read()


READERS = {
    "open_in": lambda root, name: open_in(root, name).read(),
    "read_in": lambda root, name: read_in(root, name),
    "read_json_in": lambda root, name: read_json_in(root, name),
    "opened": _read_through_opened,
    "safetensors_problem": lambda root, name: safetensors_problem(root / name, root=root),
    "load_json": lambda root, name: load_json(root / name, root=root),
    "check_tree": lambda root, name: check_tree(root, Path(name).parts[0] if "/" in name else None),
}
READ_CASES = [(n, k) for n in NAMES for k in LINKS if not (k == "folder" and "/" not in n)]


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize(("name", "link"), READ_CASES)
def test_a_file_linked_out_of_a_received_folder_is_never_read(tmp_path, name, link, reader):
    root, mine = hostile(tmp_path, name, link)
    with pytest.raises(OutsideRunFolder) as refused:
        READERS[reader](root, name)
    message = str(refused.value)
    assert "\n" not in message and "leads out of the run folder" in message and Path(name).parts[0] in message
    assert untouched(mine) and not descriptors_of(mine)


WRITERS = {
    "write_in_run": lambda root, name: write_in_run(root, name, b"{}"),
    "append": lambda root, name: open_in(root, name, "ab").write(b"{}"),
    "update": lambda root, name: open_in(root, name, "r+b").write(b"{}"),
}
WRITE_CASES = [(n, k) for n in NAMES for k in ("absolute", "folder", "hard") if not (k == "folder" and "/" not in n)]


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize(("name", "link"), WRITE_CASES)
def test_a_file_linked_out_of_a_received_folder_is_never_written_through(tmp_path, name, link, writer):
    """A file written whole replaces a symbolic or hard link in its place (the folder then holds its own file); one
    written in place (appended, updated) is refused; a folder on the way that leads out is refused for all."""
    if link == "hard":
        root, mine = hostile(tmp_path, name, "absolute")
        (root / name).unlink()
        os.link(mine, root / name)
    else:
        root, mine = hostile(tmp_path, name, link)
    if writer == "write_in_run" and link != "folder":
        WRITERS[writer](root, name)
        assert (root / name).read_bytes() == b"{}" and not (root / name).is_symlink()
        assert os.stat(root / name).st_nlink == 1
    else:
        with pytest.raises(OutsideRunFolder) as refused:
            WRITERS[writer](root, name)
        assert "\n" not in str(refused.value)
    assert untouched(mine) and not descriptors_of(mine)
    assert sorted(p.name for p in mine.parent.iterdir()) in (["victim.txt"], ["theirs", "victim.txt"])


@pytest.mark.parametrize("swapped", ["student", "checkpoints/step_00000001", "checkpoints/step_00000001/state.json"])
def test_a_name_swapped_for_a_link_between_the_check_and_the_open_is_refused(tmp_path, monkeypatch, swapped):
    """What is opened is checked, not only its name: the folder (or file) is replaced by a link out after the
    names were resolved and before the walk opens them; the walk meets the link (O_NOFOLLOW) and refuses."""
    from wandistiller.core import files

    root, mine = tmp_path / "run", victim(tmp_path)
    name = "checkpoints/step_00000001/state.json" if swapped != "student" else "student/config.json"
    (root / name).parent.mkdir(parents=True)
    (root / name).write_text("{}")
    checked = files._resolved_parts

    def swap_after_the_check(*args):
        found = checked(*args)
        target = root / swapped
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        target.symlink_to(mine if target.suffix else mine.parent)
        return found

    monkeypatch.setattr(files, "_resolved_parts", swap_after_the_check)
    with pytest.raises(OutsideRunFolder, match="replaced by a link while it was being opened"):
        read_in(root, name)
    assert untouched(mine) and not descriptors_of(mine)


def test_links_inside_a_folder_and_hard_links_read_as_the_folders_own(tmp_path):
    root = tmp_path / "run"
    (root / "checkpoints" / "step_00000002").mkdir(parents=True)
    (root / "checkpoints" / "step_00000002" / "state.json").write_text('{"step": 2}')
    (root / "checkpoints" / "latest").symlink_to("step_00000002")
    os.link(root / "checkpoints" / "step_00000002" / "state.json", root / "copy.json")
    assert read_json_in(root, "checkpoints/latest/state.json") == {"step": 2} == read_json_in(root, "copy.json")
    assert check_tree(root) == root


def test_a_fifo_or_a_folder_is_refused_without_blocking(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    os.mkfifo(root / "metrics.json")
    with pytest.raises(UserError, match="not a regular file"):
        read_in(root, "metrics.json")  # O_NONBLOCK: no writer needed for the refusal
    (root / "folder").mkdir()
    with pytest.raises(UserError, match="not a regular file"):
        read_in(root, "folder")


def test_the_guard_is_the_one_way_in_and_out_of_the_package():
    """Every open, read_text, write_text, read_bytes, write_bytes, safe_open, load_file, from_pretrained,
    load_lora_weights, lora_state_dict, from_single_file, json.load and Image.open call in the package goes through
    core.files' guard: the builtin ways never (outside the guard itself and the allow-list below), a library that takes
    a path or a file only in a function that opens it through the guard or checks it (`opened`, `check_tree`,
    `open_in`)."""
    import ast

    package = Path(__file__).resolve().parents[2] / "wandistiller"
    raw = {"open", "read_text", "write_text", "read_bytes", "write_bytes"}
    # Loaders that take a path and open it themselves: diffusers' LoRA readers included (a LoRA student's adapters).
    by_path = {"safe_open", "load_file", "from_pretrained", "load_lora_weights", "lora_state_dict", "from_single_file"}
    guards = {"opened", "check_tree", "open_in", "read_in", "read_text_in", "read_json_in", "write_in_run"}
    bypasses = []
    for file in sorted(package.rglob("*.py")):
        module = file.relative_to(package).as_posix()
        if any(module.startswith(p) for p in ALLOWED_MODULES):
            continue
        tree = ast.parse(file.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            calls = [n for n in ast.walk(function) if isinstance(n, ast.Call)]
            names = [(c, c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", None)) for c in calls]
            guarded = any(n in guards for _, n in names)
            for call, name in names:
                owner = getattr(getattr(call.func, "value", None), "id", None)
                # json.load and PIL's Image.open take an open file (or a path): a guarded one, in a guarded function
                # a figure's savefig too: given a path, it would write through a link in its place
                takes_file = (name, owner) in (("load", "json"), ("open", "Image")) or name == "savefig"
                if owner == "os" or (module, function.name) in ALLOWED_CALLS:  # os.open: the caller's own flags
                    continue
                if (name in raw and not takes_file) or ((name in by_path or takes_file) and not guarded):
                    bypasses.append(f"{module}:{call.lineno} {function.name}: {name}")
    assert not bypasses, "these open files without core.files' guard:\n" + "\n".join(sorted(set(bypasses)))


# What may open files without the guard, and why: never a received folder's files.
ALLOWED_MODULES = (
    "core/files.py",  # the guard itself
    "teacher/",  # the teacher's own files: the user's choice (a Hub cache snapshot is links into its blobs by design)
    "placements/",  # the teacher's files again, placed (disk: converted copies in this machine's cache)
    "pocket/",  # the shipped pocket teacher and judge, and their build into the package's assets
    "bench/",  # developer benchmarks, on run folders they make themselves and /proc
)
ALLOWED_CALLS = {
    ("core/atomic.py", "umask"): "/proc/self/status",
    ("core/tensor_files.py", "safetensors_header"): "the user's own weights (a teacher); a received folder's through "
    "open_in",
    ("core/hydra.py", "shared_now"): "/proc: the parent process's start time",
    ("recipe/loop.py", "_peak_rss_kib"): "/proc/self/status",
    ("state/received.py", "_shipped_targets"): "the shipped conf/ tree",
    ("state/received.py", "local_cache_dir"): "the shipped conf/train.yaml",
    ("state/checkpoint.py", "_weights_files"): "the teacher's weights files (its digests)",
    ("state/export.py", "model_index"): "the teacher's model_index.json",
    ("state/export.py", "teacher_index"): "the teacher's model_index.json",
    ("state/card.py", "example_prompt"): "a shipped prompts file (never a received run's own)",
    ("recipe/methods/dmd.py", "teacher_shaped"): "the teacher's transformer",
    ("data/latents.py", "cache_key"): "the teacher's configs, for the cache key",
    ("data/latents.py", "load_latent_bank"): "this machine's cache (a received run's caches are never its sender's)",
    ("data/prompts.py", "_cache_key"): "the teacher's text encoder config",
    ("data/prompts.py", "_encode_and_cache"): "the teacher's text encoder",
    ("data/prompts.py", "read_prompts"): "a prompts file the user names (--prompts), or a shipped one; a received "
    "run's saved prompts file is read only inside the run folder (evaluation/evaluate.py's eval_prompts)",
    ("data/images.py", "_text"): "the user's data folder (data.root; a received run's only with --allow-data)",
    ("data/images.py", "folder_source"): "the user's data folder, as above",
    ("data/images.py", "_one_frame_gif"): "the user's data folder, as above",
    ("data/images.py", "_pixels"): "the user's data folder, as above",
    ("data/images.py", "_dataset_files_inside"): "the user's data folder, as above",
    ("data/images.py", "image_latents"): "the teacher's vae/config.json",
    ("data/videos.py", "_pil_frames"): "the user's data folder (data.root of data=video_folder), as images'",
    ("data/videos.py", "_av_frames"): "the user's data folder, as above",
    ("evaluation/metrics.py", "_folder_images"): "the user's --fid-reference folder",
    ("evaluation/metrics.py", "check_real_metrics"): "the user's --fid-reference folder",
    ("evaluation/metrics.py", "_clip_model"): "the user's --clip-model folder or Hub id",
    ("generate.py", "first_frames"): "the images the user names on the command line (--image)",
    ("student/model.py", "_read_student_json"): "student.config_path, a file the user names",
    ("state/formats/diffusers.py", "_build"): "a folder this process assembled: the student checked (check_tree) "
    "and placed through the guard, the teacher the user's own",
    ("state/formats/diffusers.py", "_build_lora"): "as _build: the teacher's pipeline and the adapters placed through "
    "the guard",
}


def test_a_file_where_a_folder_should_be_is_not_called_a_swapped_link(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "student").write_text("a file")
    with pytest.raises(UserError) as refused:
        read_in(root, "student/config.json")
    assert "cannot be read (Not a directory)" in str(refused.value) and "link" not in str(refused.value)
