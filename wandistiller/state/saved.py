"""A received run's saved config read as values safe to show: a key as saved (never resolved: a `${oc.env:...}` stays
unread), a finite number, a plain word, a path named by its last part. The model card and the exports name the
teacher, the data and the LoRAs with these, never with a path of this machine or a received file's text."""

from __future__ import annotations

import math
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from wandistiller.core.files import read_json_in

SHIPPED = "${wd_assets:"  # a shipped asset's path in a saved config (a teacher, its prompts, its images)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
WORD = re.compile(r"[\w.+ -]{1,100}")


def raw_value(node, key: str):
    """`node.key` as saved, never resolved: a received config's `${oc.env:HF_TOKEN}` stays unread."""
    saved = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else None
    return saved.get(key) if isinstance(saved, dict) else None


def saved_number(value) -> float | None:
    """A figure for the card: a finite int or float, else None (a string of a received file is no figure)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def saved_word(value) -> str | None:
    """A name safe on one line of the card: letters, digits and ._+- only (no newline, no markup)."""
    return value if isinstance(value, str) and WORD.fullmatch(value) else None


def last_part(raw: str) -> str | None:
    """A saved path's last part, where it is a plain name (no folder of this machine); None for an
    interpolation, which is not evaluated (it may read the environment)."""
    return saved_word(Path(raw).name) if "${" not in raw else None


def named_path(raw, what: str) -> str:
    """A path of the config as the card names it: shipped, or by its last part alone."""
    if raw is None:
        return f"the shipped {what}"
    if str(raw).startswith(SHIPPED):
        return f"the {what} shipped with WanDistiller"
    return f"`{last_part(str(raw))}`" if last_part(str(raw)) else f"your {what}"


SHA256 = re.compile(r"[0-9a-f]{64}")


def run_loras(run_dir: Path) -> list[dict]:
    """The LoRAs the run's teacher was fine-tuned with (teacher.lora), as metrics.json names them: each one's file
    name, strength, experts and sha256, read as data (a name that is not a plain word is left out); [] for none."""
    try:
        m = read_json_in(run_dir, "metrics.json", what="metrics.json") if (run_dir / "metrics.json").is_file() else {}
    except ValueError:
        return []
    found = m.get("teacher_loras") if isinstance(m, dict) else None
    out: list[dict] = []
    for r in found if isinstance(found, list) else []:
        if not isinstance(r, dict):
            continue
        experts = r.get("experts")
        experts = experts if isinstance(experts, list) else []
        sha = r.get("sha256") if isinstance(r.get("sha256"), str) and SHA256.fullmatch(r["sha256"]) else None
        out.append(
            {
                "file": saved_word(r.get("file")) or "?",
                "strength": saved_number(r.get("strength")),
                "experts": [e for e in experts if e in ("transformer", "transformer_2")],
                "sha256": sha,
            }
        )
    return out
