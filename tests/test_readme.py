"""Every fenced command in README.md and docs/ runs as written (in the set-up environment), or -- where it
needs hardware this machine lacks (a GPU, a cluster, your own package, the network) -- stops with exactly
one `error:` line. The default lane checks each command's config composes and each is accounted for; the
slow lane runs them all, in order, in a fresh folder (a new user's checkout)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
HAS_GPU = shutil.which("nvidia-smi") is not None

# (a fragment of the command, what it needs here): the first that matches decides. "run": exit 0.
NEEDS = [
    ("make ", "make"),
    ("wandistiller.plan", "run"),  # plans on paper: runs anywhere
    ("hf download", "network"),
    ("pip install", "network"),
    ("gpu_wheels.sh", "network"),  # downloads the wheels the GPU machine lacks
    ("wandistiller.pocket.build", "long"),  # 17 min; its --quick build runs in test_pocket (slow lane)
    ("wandistiller.pocket.style", "long"),  # minutes, and it rewrites the shipped file; 2 steps in tests/pocket (slow)
    ("wandistiller.quality", "long"),  # 35 min; its small scale runs in test_pocket (slow lane)
    ("student=half data=pocket_digits trainer.max_steps=1000", "long"),  # 3 min; the comparison's rows, small
    ("data.root=my_clips", "long"),  # a run on your own videos: tests/data/test_videos.py trains on a video folder
    ("+experiment=pocket", "long"),  # 5-10 min each; tests/pocket/test_build.py runs each for a few steps (slow)
    ("hydra/launcher=slurm", "cluster"),
    ("mypkg.", "your package"),
    ("--device cuda", "gpu"),
    ("--arch 14b", "gpu"),
    ("teacher=wan", "gpu"),
    ("teacher.path=models/", "gpu"),
    ("nproc_per_node=4", "gpu"),
    ("teacher_placement=gpu ", "gpu"),
    ("teacher_placement=offload", "gpu"),
    ("teacher_placement=balanced", "gpu"),
    ("outputs/wan13b", "the GPU run before it"),
    ("outputs/a14b-lora", "the GPU run before it"),  # a LoRA student of the A14B pair (docs/REAL_MODEL.md)
    ("", "run"),
]
REFUSAL_WORDS = {  # what the one line says, per need
    "gpu": ("GPU", "CUDA", "not found", "no local config", "sbatch"),
    "cluster": ("sbatch",),
    "your package": ("cannot be imported", "No module named"),
    "the GPU run before it": ("is not a run folder",),
}


def fenced_commands(path: Path) -> list[tuple[str, int, str]]:
    """(file, line, command) for each command in the file's ```bash blocks: continuations joined,
    comments dropped."""
    found, block, start, pending = [], False, 0, ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            block = line.strip() == "```bash" and not block
            continue
        if not block:
            continue
        text = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not text:
            continue
        start = start if pending else n
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        found.append((path.relative_to(ROOT).as_posix(), start, pending + text))
        pending = ""
    return found


def first_of_each(commands: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """Each command once, where it first appears: the README repeats a few of docs/' commands, which run the same."""
    first: dict[str, tuple[str, int, str]] = {}
    for c in commands:
        first.setdefault(c[2], c)
    return list(first.values())


COMMANDS = first_of_each([c for doc in DOCS for c in fenced_commands(doc)])


def need(command: str) -> str:
    kind = next(k for fragment, k in NEEDS if fragment in command)
    return "run" if kind == "gpu" and HAS_GPU else kind


def test_the_docs_have_commands_and_say_how_to_activate_the_environment():
    readme = (ROOT / "README.md").read_text()
    assert len(COMMANDS) > 30 and "source .venv/bin/activate" in readme.split("```bash", 2)[1]
    for doc in DOCS:  # the docs speak to users of this repository: nothing outside it
        assert "../shared" not in doc.read_text(), doc


@pytest.mark.parametrize("where,line,command", COMMANDS, ids=[f"{w}:{n}" for w, n, _ in COMMANDS])
def test_every_train_command_composes_and_every_make_target_exists(where, line, command):
    from wandistiller.compose import check_overrides

    words = command.split()
    if words[:3] == ["python", "-m", "wandistiller.train"] or (
        words[0] == "torchrun" and "wandistiller.train" in words
    ):
        check_overrides(words[words.index("wandistiller.train") + 1 :])
    elif "make" in words:
        make = next(part for part in command.split("&&") if part.split()[0] == "make")
        targets = [w for w in make.split()[1:] if "=" not in w]
        assert subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True).returncode == 0, command


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory, cache_dir):
    """A fresh folder with the files the docs' commands name as the user's own."""
    from PIL import Image

    home = tmp_path_factory.mktemp("newcomer")
    (home / "my_prompts.txt").write_text("\n".join(f"a red fox number {i} in the snow" for i in range(12)) + "\n")
    images = home / "my_images"
    images.mkdir()
    for i in range(4):
        Image.new("RGB", (64, 64), (60 * i, 90, 200 - 40 * i)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"a plain colour field, number {i}")
    try:
        import datasets

        rows = {"image": [Image.new("RGB", (64, 64), (30 * i, 60, 90)) for i in range(4)],
                "text": [f"a flat field {i}" for i in range(4)]}  # fmt: skip
        datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image()).save_to_disk(home / "my_hf_dataset")
    except ImportError:
        pass
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "WANDISTILLER_CACHE": str(cache_dir), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    seed = subprocess.run([sys.executable, "-m", "wandistiller.train", "debug=fast", f"hydra.run.dir={home}/.seed"],
                          cwd=home, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert seed.returncode == 0, seed.stderr[-2000:]
    shutil.copy(home / ".seed" / "student" / "config.json", home / "student_config.json")  # "a config.json of yours"
    return home, env


def as_run_here(command: str, home: Path) -> str:
    """The command as the user types it, with the sweeps the docs compare pointed at one made here."""
    if "multirun/BEFORE" in command:
        sweeps = sorted(p for p in (home / "multirun").glob("*/*") if (p / "sweep_report.md").is_file())
        command = command.replace("multirun/BEFORE", str(sweeps[0])).replace("multirun/AFTER", str(sweeps[-1]))
    if command.startswith("python scripts/"):
        command = command.replace("python scripts/", f"python {ROOT}/scripts/", 1)
    return command


@pytest.mark.slow
@pytest.mark.parametrize("where,line,command", COMMANDS, ids=[f"{w}:{n}" for w, n, _ in COMMANDS])
def test_every_command_runs_as_written_or_names_what_it_needs_in_one_line(where, line, command, newcomer):
    home, env = newcomer
    kind = need(command)
    if kind in ("make", "network", "long"):
        pytest.skip(f"{kind}: checked by the default lane (make -n) / needs the internet / runs small elsewhere")
    done = subprocess.run(as_run_here(command, home), shell=True, cwd=home, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    out = done.stdout + done.stderr
    if kind == "run":
        assert done.returncode == 0, f"{where}:{line} {command}\n{out[-3000:]}"
        return
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert done.returncode != 0 and len(errors) == 1, f"{where}:{line} {command}\n{out[-3000:]}"
    # torchrun's agent adds its own report (a ChildFailedError traceback) for any rank that exits non-zero.
    assert command.startswith("torchrun") or "Traceback" not in out, out[-3000:]
    assert any(w in errors[0] for w in REFUSAL_WORDS[kind]), errors[0]


def test_a_new_docs_command_must_be_classified_here_or_run():
    # The table above stays honest: every refusal it expects names a need the README itself states.
    text = "\n".join(d.read_text() for d in DOCS)
    for fragment, kind in NEEDS:
        if kind in ("gpu", "cluster") and fragment:
            assert any(fragment in c for _, _, c in COMMANDS), f"stale entry {fragment!r}"
    assert re.search(r"need(s)? (a CUDA GPU|GPUs)", text)


def test_the_readme_and_the_makefile_give_make_train_one_time():
    """They said ~50 s and ~75 s; docs/PERFORMANCE.md holds the measurements both now quote."""
    readme = (ROOT / "README.md").read_text()
    readme_says = readme[readme.index("make train    #") :].split("\nmake test")[0]
    make_says = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("train:"))
    times = [re.search(r"\(~(\d+ (?:s|min)) on 2 quiet", said) for said in (readme_says, make_says)]
    assert times[0] and times[1] and times[0][1] == times[1][1], (readme_says, make_says)
    assert "docs/PERFORMANCE.md" in readme_says and "docs/PERFORMANCE.md" in make_says


def test_every_figure_the_readme_quotes_is_held_by_performance_or_quality():
    """A figure is quoted only where docs/PERFORMANCE.md or docs/QUALITY.md holds it with its command, machine and
    date: the README once claimed GPU ratios (1.003x, 3.2 GiB) that no measurement in the repository had."""
    readme = (ROOT / "README.md").read_text()
    held = (ROOT / "docs" / "PERFORMANCE.md").read_text() + (ROOT / "docs" / "QUALITY.md").read_text()
    figures = set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:%|x\b| GiB| samples/s| ms)", readme))
    assert len(figures) > 5 and not sorted(f for f in figures if f not in held)


# Options the docs name on purpose that do not compose: (the override, why). Each must still be written somewhere.
NOT_OPTIONS = {
    "data=scaled": "docs/ARCHITECTURE.md's how-to adds it (tests/core/test_extensions.py builds it)",
    "data.x0_scale=0.3": "the same how-to's option key",
    "data.x0_scale=-1": "the same how-to's refused value",
    "method=fast": "docs/DEVELOPMENT.md's plugin example",
    "logger=[lines]": "docs/DEVELOPMENT.md's plugin example",
    "precision.student_dtype=fp64": "docs/USAGE.md's example of a value refused at composition",
}
OVERRIDE = re.compile(r"^[+~]{0,2}[a-z][a-z0-9_]*(\.[a-z0-9_]+)*=[^\s`]*$")
FILE_SUFFIXES = (".py", ".md", ".json", ".yaml", ".png", ".jsonl", ".safetensors", ".pt", ".txt")
PLACEHOLDER = re.compile(r"^$|[<>…]|\.\.\.|^[A-Z][A-Z_]*$|^\[?[A-Z]+,")  # `N`, `<run>/student`, `[FILE,...]`


def written_overrides() -> set[str]:
    """Every `key=value` in README.md and docs/ outside the ```bash blocks (those are composed whole, above), and
    every key written alone in backticks (`trainer.loss.alpha`)."""
    found = set()
    for doc in DOCS:
        text = re.sub(r"```bash.*?```", "", doc.read_text(), flags=re.S)
        found |= {k for k in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+)`", text) if not k.endswith(FILE_SUFFIXES)}
        for word in text.split():
            word = re.sub(r"'s$", "", word.strip("`'\"*(),;:."))
            if OVERRIDE.match(word):
                found.add(word)
    return found


def test_every_option_key_the_docs_write_composes():
    """Prose names options too (`trainer.loss.hidden_kd_weight`, `teacher_placement=offload`): each one written
    composes with the option that owns its key, and each choice is an option of its group. Placeholders
    (`trainer.batch_size=N`) check the key only. Python keywords and other `a=b` text name no config key."""
    from omegaconf import OmegaConf

    from wandistiller.compose import register_configs
    from wandistiller.core.hydra import CONF_DIR, compose_tree
    from wandistiller.core.plugins import conf_options
    from wandistiller.core.renamed import MOVED_KEYS  # the older keys, which still run (with a warning)

    register_configs()
    composed: dict[tuple[str, ...], object] = {}

    def compose(overrides: tuple[str, ...]):
        if overrides not in composed:
            try:
                composed[overrides] = compose_tree("train", list(overrides))
            except Exception as e:
                composed[overrides] = e
        return composed[overrides]

    def package(group: str) -> str:  # where a group's option lands (`# @package trainer.loss`), else its name
        first = next(iter(sorted((CONF_DIR / group).glob("*.yaml"))), None)
        header = first.read_text().splitlines()[0] if first else ""
        return header.split("@package", 1)[1].strip() if "@package" in header else group

    def has(context: tuple[str, ...], key: str) -> bool:
        tree = compose(context)
        return not isinstance(tree, Exception) and OmegaConf.select(tree, key, default=KeyError) is not KeyError

    groups = {package(g.name): g.name for g in CONF_DIR.iterdir() if g.is_dir() and g.name != "hydra"}
    top = compose(())
    problems, checks = [], {}  # checks: {context: [override]}, composed in batches of distinct keys
    for word in sorted(written_overrides() - set(NOT_OPTIONS) - set(MOVED_KEYS)):
        key, value = (word.lstrip("+~").split("=", 1) + [""])[:2]
        if key.split(".")[0] not in top and key != "experiment":
            continue  # not a config key (a Python keyword, a field of a file)
        values = [v for v in re.split(r"\\?\|", value) if v] or [""]
        if "." not in key:  # a choice: each name given is an option of the group
            names = [n for v in values for n in v.strip("[]").split(",")]
            wrong = [n for n in names if not PLACEHOLDER.search(n) and n not in conf_options(key)]
            problems += [f"{word}: {key} has no option {n}" for n in wrong]
            continue
        owner = max((p for p in groups if key.startswith(p + ".")), key=len, default=None)
        choices = conf_options(groups[owner]) if owner and not word.startswith("+") else []
        contexts = [()] + [(f"{groups[owner]}={o}",) for o in choices] + [(f"{groups[owner]}=[{o}]",) for o in choices]
        context = next((c for c in contexts if has(c, key) or word.startswith("+")), None)  # the first that has it
        if context is None:
            problems.append(f"{word}: no option composes the key {key}")
            continue
        for v in values:
            if not PLACEHOLDER.search(v):
                checks.setdefault(context, []).append(f"{word.split('=', 1)[0]}={v}")
    for context, overrides in checks.items():
        batches: list[list[str]] = []  # each key once per batch: a later value would hide an earlier one
        for o in overrides:
            batch = next((b for b in batches if o.split("=")[0] not in {x.split("=")[0] for x in b}), None)
            batch.append(o) if batch is not None else batches.append([o])
        for batch in batches:
            if isinstance(compose(context + tuple(batch)), Exception):
                problems += [f"{o}: {compose(context + (o,))}"[:300] for o in batch
                             if isinstance(compose(context + (o,)), Exception)]  # fmt: skip
    assert not problems, "\n".join(problems)
    text = "\n".join(d.read_text() for d in DOCS)
    assert all(example in text for example in NOT_OPTIONS), "a NOT_OPTIONS entry the docs no longer write"
    assert isinstance(compose(("precision.student_dtype=fp64",)), Exception)
