"""`wandistiller.generate`: images from a run's student (and its teacher) through `run_generate` on a real short run;
where a path leads (`locate`), the image files `write_images` names, and the arguments, called directly."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from wandistiller import generate as generate_cli
from wandistiller.core.errors import UserError
from wandistiller.state.runs import open_run
from wandistiller.teacher.spec import inspect_teacher
from wandistiller.teacher.vae import load_vae


def test_generate_writes_student_and_teacher_pngs(run_dir, tmp_path):
    args = generate_cli.parse_args([str(run_dir / "student"), "--prompt", "a red fox", "--steps", "2", "--teacher"])
    args.out = str(tmp_path / "out")
    paths = generate_cli.run_generate(args)
    # --steps 2, not the default 20: a KD student and the teacher drew them at 2, and their names say so
    assert [p.name for p in paths] == ["a-red-fox_seed0_student2.png", "a-red-fox_seed0_teacher2.png"]
    assert all(Image.open(p).size == (64, 64) for p in paths)


def test_images_are_named_by_a_short_slug_of_their_prompt_its_seed_and_who_drew_it(tiny_path, tmp_path):
    vae = load_vae(inspect_teacher(tiny_path), torch.device("cpu"))
    prompts = ["A Red Fox, in the SNOW!", "!!!", "word " * 20]
    latents = torch.zeros(3, 16, 1, 8, 8)  # the tiny teacher's latents: 16 channels, 8x8 for a 64x64 image
    paths = generate_cli.write_images(latents, vae, prompts, tmp_path / "new" / "out", "student", 7)
    digest = lambda prompt: hashlib.sha256(prompt.encode()).hexdigest()[:6]
    assert [p.name for p in paths] == [  # where the slug loses some of the prompt, a digest of it follows
        f"a-red-fox-in-the-snow-{digest(prompts[0])}_seed7_student.png",
        f"prompt-{digest('!!!')}_seed7_student.png",  # nothing to slug: a name still
        f"{'word-' * 9}wor-{digest(prompts[2])}_seed7_student.png",  # at most 48 characters of the prompt
    ]
    assert all(Image.open(p).size == (64, 64) and Image.open(p).mode == "RGB" for p in paths)


def test_prompts_that_read_the_same_each_keep_their_image(tiny_path, tmp_path):
    """Issue 41: `--prompt "a fox" --prompt "A fox!"` (or one prompt twice, each from its own noise) wrote one file,
    the second image over the first; each now has its own name, the first as before. An audit's: across calls too
    (`A fox!` in a later call replaced `a fox`'s image, as did any two prompts in Japanese)."""
    vae = load_vae(inspect_teacher(tiny_path), torch.device("cpu"))
    prompts = ["a fox", "A fox!", "a fox", "a fox 2", "日本語", "赤い"]
    paths = generate_cli.write_images(torch.zeros(6, 16, 1, 8, 8), vae, prompts, tmp_path, "student", 0)
    digest = lambda prompt: hashlib.sha256(prompt.encode()).hexdigest()[:6]
    names = ["a-fox", f"a-fox-{digest('A fox!')}", "a-fox+2", "a-fox-2", f"prompt-{digest('日本語')}"]
    assert [p.name for p in paths] == [f"{n}_seed0_student.png" for n in names + [f"prompt-{digest('赤い')}"]]
    assert len(set(paths)) == 6 and all(p.is_file() for p in paths)
    for prompt in set(prompts) - {"a fox"}:  # each alone, in a call of its own: another prompt's name never
        assert generate_cli.prompt_slugs([prompt]) != generate_cli.prompt_slugs(["a fox"])


def test_a_seed_too_long_to_name_an_image_is_one_line_before_any_work():
    """Issue 41: a 300-digit --seed drew the images, then died on a file name too long for the system."""
    big = "9" * 300
    with pytest.raises(UserError, match=r"^--seed is 300 digits long; give a whole number from -\d+ to \d+$"):
        generate_cli.parse_args(["run", "--prompt", "x", "--seed", big])
    assert generate_cli.parse_args(["run", "--prompt", "x", "--seed", str(2**63 - 1)]).seed == 2**63 - 1


def test_a_student_folder_outside_a_run_folder_is_refused_in_one_line(tmp_path):
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        generate_cli.locate(str(tmp_path / "student"), None)
    where = tmp_path / "student"
    assert str(e.value) == f"{where} is a student folder outside a run folder; give its run folder instead"


def test_prompts_repeat_and_the_defaults_are_twenty_steps_seed_0_and_the_runs_own_folder():
    args = generate_cli.parse_args(["run", "--prompt", "a fox", "--prompt", "a cat"])
    assert args.prompt == ["a fox", "a cat"] and (args.steps, args.seed, args.out, args.teacher) == (20, 0, None, False)
    assert args.student_steps is None and generate_cli.parse_args(["run", "--prompt", "x", "--seed", "-3"]).seed == -3


def test_generate_into_a_received_run_never_writes_through_a_link_and_refuses_another_teacher(finished, tmp_path):
    import shutil

    from tests.core.test_files import untouched, victim
    from tests.evaluation.test_evaluate import POCKET

    mine = victim(tmp_path)
    folder = tmp_path / "received"
    shutil.copytree(finished, folder)  # a legitimate run moved to another machine: it generates
    (folder / "generated").mkdir()
    (folder / "generated" / "a-fox_seed0_student1.png").symlink_to(mine)
    args = generate_cli.parse_args([str(folder), "--prompt", "a fox", "--steps", "1"])
    [path] = generate_cli.run_generate(args)
    assert path == folder / "generated" / "a-fox_seed0_student1.png" and not path.is_symlink()
    assert Image.open(path).size == (64, 64) and untouched(mine)
    shutil.rmtree(folder / "generated")
    (folder / "generated").symlink_to(mine.parent)
    with pytest.raises(UserError, match="generated leads out of the run folder"):
        generate_cli.run_generate(args)
    assert sorted(p.name for p in mine.parent.iterdir()) == ["victim.txt"] and untouched(mine)
    other = generate_cli.parse_args([str(folder), "--prompt", "a fox", "--teacher-path", str(POCKET), "--out",
                                     str(tmp_path / "out")])  # fmt: skip
    with pytest.raises(UserError, match="does not fit this teacher: .* --allow-other-teacher"):
        generate_cli.run_generate(other)
    assert not (tmp_path / "out").exists()


def test_generate_samples_a_few_step_student_at_its_k_unless_told(finished, tmp_path):
    from tests.state.test_runs import few_step_copy

    folder = few_step_copy(finished, tmp_path, 2)
    paths = {}
    for extra in ([], ["--student-steps", "2"], ["--student-steps", "1"]):
        args = generate_cli.parse_args([str(folder), "--prompt", "a fox", *extra])
        args.out = str(tmp_path / f"out{len(paths)}")
        [paths[tuple(extra)]] = generate_cli.run_generate(args)
    own, two, one = (p.read_bytes() for p in paths.values())
    assert own == two != one  # its K (2) by default, not --steps' 20


def test_images_drawn_otherwise_get_their_own_names_and_the_default_keeps_its_own(finished, tmp_path):
    from tests.state.test_runs import few_step_copy

    folder = few_step_copy(finished, tmp_path, 2, method="dmd")
    out = folder / "generated"
    names = {}
    for extra in ([], ["--student-steps", "2"], ["--student-steps", "1"], ["--checkpoint", "step_1"],
                  ["--dtype", "bf16"], ["--teacher", "--steps", "3"]):  # fmt: skip
        args = generate_cli.parse_args([str(folder), "--prompt", "a fox", *extra])
        names[" ".join(extra)] = [p.name for p in generate_cli.run_generate(args)]
    assert names == {
        "": ["a-fox_seed0_student.png"],  # its own K, as always
        "--student-steps 2": ["a-fox_seed0_student.png"],  # its K asked for: the same image
        "--student-steps 1": ["a-fox_seed0_student1.png"],  # not over the one drawn at K
        "--checkpoint step_1": ["a-fox_seed0_student_step_00000001.png"],
        "--dtype bf16": ["a-fox_seed0_student_bf16.png"],  # the run's is fp32
        "--teacher --steps 3": ["a-fox_seed0_student.png", "a-fox_seed0_teacher3.png"],  # --steps: the teacher's
    }
    assert len({p.read_bytes() for p in out.iterdir()}) == 5  # five images, none written over another
    assert generate_cli.drawn_by("teacher", 20, 20) == "teacher"  # a KD student and the teacher at --steps 20


@pytest.mark.parametrize(("extra", "message"), [
    (["--steps", "5000"], "--steps 5000 is more than this teacher's 1000 training timesteps"),
    (["--student-steps", "1001"], "--student-steps 1001 is more than this teacher's 1000 training timesteps"),
    (["--out", "/sys/wd-images"], "--out: /sys cannot be written"),
    (["--out", "/proc/wd-images"], "--out: /proc cannot be written"),
    (["--out", "fox.PNG"], r"--out fox.PNG names a file, but --out is a folder \(each .*\(e.g. --out fox\)"),
])  # fmt: skip
def test_generate_checks_its_counts_and_its_output_before_any_work(finished, tmp_path, extra, message, monkeypatch):
    """Refused in one line before the prompts are encoded, nothing written into the run."""
    import shutil

    folder = tmp_path / "received"
    shutil.copytree(finished, folder)
    monkeypatch.setattr(generate_cli, "encode_prompts", lambda *a, **k: pytest.fail("work began before the checks"))
    with pytest.raises(UserError, match=message) as e:
        generate_cli.run_generate(generate_cli.parse_args([str(folder), "--prompt", "a fox", *extra]))
    assert "\n" not in str(e.value) and not (folder / "generated").exists()  # nothing written into the run
    assert not Path("fox.PNG").exists()


@pytest.mark.parametrize(
    "inside", ["student", "checkpoints/step_00000001", "teacher", ".hydra", "pipeline/transformer"]
)
def test_generate_never_writes_among_what_the_run_is_read_from(finished, tmp_path, tiny_path, inside, monkeypatch):
    """--out in the teacher's folder wrote pictures into a model folder (the package's own pocket teacher, once)."""
    import shutil

    folder = tmp_path / "received"
    shutil.copytree(finished, folder)
    out = tiny_path / "pictures" if inside == "teacher" else folder / inside
    monkeypatch.setattr(generate_cli, "encode_prompts", lambda *a, **k: pytest.fail("work began before the checks"))
    what = generate_cli.RUNS_OWN.get(inside.split("/")[0], "the teacher's folder")
    with pytest.raises(UserError, match=f"--out: {out} is {what} or inside it"):
        generate_cli.run_generate(generate_cli.parse_args([str(folder), "--prompt", "a fox", "--out", str(out)]))
    assert not (tiny_path / "pictures").exists()
    if inside != "teacher":  # an audit's: another run's folders took the pictures, and its next resume dropped them
        another = f"--out: {tmp_path / 'other' / inside} is {what.replace('the run', 'another run')} or inside it"
        shutil.copytree(finished, tmp_path / "other")
        with pytest.raises(UserError, match=another):
            argv = [str(folder), "--prompt", "a fox", "--out", str(tmp_path / "other" / inside)]
            generate_cli.run_generate(generate_cli.parse_args(argv))


def test_an_image_drawn_against_another_teacher_is_named_for_it():
    assert generate_cli.drawn_by("student", 4, 4, None, None, "teacher-0123456789ab") == "student_teacher-0123456789ab"
    assert generate_cli.drawn_by("teacher", 20, 20) == "teacher"


@pytest.mark.parametrize("teacher", ["tiny_i2v", "tiny_i2v_moe"])
def test_generate_continues_an_image_to_video_students_given_first_frame_and_refuses_what_cannot_be_one(
    make_cfg, tmp_path, teacher, tiny_path
):
    """Issue 42: `generate --image` draws an I2V student (and with --teacher its teacher) through the model's own
    WanImageToVideoPipeline from the given frame, which changes the clip; an image too small, unreadable, or one
    too many, and an image for a text-to-video run, are one line each before any work."""
    import numpy as np

    from tests.data.sources.test_images import given_images, pairs
    from wandistiller.train import run

    root, folder = given_images(tmp_path / "images"), tmp_path / "run"
    run(make_cfg(*pairs(root, f"teacher={teacher}"), run_dir=folder))
    base = [str(folder), "--prompt", "a fox", "--steps", "2"]
    drawn = {}
    for name in ("img0", "img1"):
        args = generate_cli.parse_args([*base, "--image", str(root / f"{name}.png"), "--teacher"])
        args.out = str(tmp_path / name)
        paths = generate_cli.run_generate(args)
        # each image's clips under its own names (its file's and a digest of its frame): the other image's were
        # written over them, and so were those of an image of the same name in another folder
        tag = generate_cli.image_tag(str(root / f"{name}.png"), generate_cli.first_frames(args, open_run(folder))[0])
        assert tag.startswith(f"{name}-") and len(tag) == len(name) + 9
        names = [f"a-fox_{tag}_seed0_{who}2.{ext}" for who in ("student", "teacher") for ext in ("gif", "png")]
        assert [p.name for p in paths] == names
        drawn[name] = np.asarray(Image.open(paths[1]))
    assert not np.array_equal(drawn["img0"], drawn["img1"])  # the frame given is the clip's start
    Image.new("RGB", (8, 8)).save(tmp_path / "small.png")
    (tmp_path / "text.png").write_text("not an image")
    for extra, said in (
        (["--image", str(tmp_path / "small.png")], "--image: " + str(tmp_path / "small.png") + " is 8x8, too small"),
        (["--image", str(tmp_path / "text.png")], f"--image {tmp_path / 'text.png'}: not a readable image file"),
        (["--image", str(root / "img0.png")] * 2, "--image: 2 images for 1 prompts"),
        (["--image", str(tmp_path / "nope.png")], f"--image {tmp_path / 'nope.png'} does not exist; give an image"),
        (["--image", str(tmp_path)], f"--image {tmp_path} is a folder; give an image file"),
    ):
        with pytest.raises(UserError, match="^" + said.replace(".", r"\.")):
            generate_cli.run_generate(generate_cli.parse_args([*base, *extra]))
    with pytest.raises(UserError, match=r"too small .*; give a larger image$"):  # no data.* key: the run's frames
        generate_cli.run_generate(generate_cli.parse_args([*base, "--image", str(tmp_path / "small.png")]))
    assert not (folder / "generated").exists()
