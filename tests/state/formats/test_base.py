"""`wandistiller.state.formats.base`: export formats as records. The CLI is a loop over them: a format is one module
declaring `FORMAT`, found with no other edit (a new one is exported here through the CLI's own `export`); a dtype a
format does not write is one line naming the formats that do."""

from __future__ import annotations

import dataclasses
import sys

from tests.conftest import refused
from wandistiller.state.formats.base import DTYPES, ExportFormat, Request, dtype_refusal, formats


def test_the_shipped_formats_are_found_with_their_dtypes_and_defaults():
    found = formats()
    assert list(found) == ["diffusers", "single-file", "lora"]  # their `order`: as --format lists them
    assert {n: (f.dtypes, f.default_dtype, f.workflow) for n, f in found.items()} == {
        "diffusers": (("bf16", "fp16", "fp32"), None, False),
        "lora": (("bf16", "fp16", "fp32"), "bf16", True),
        "single-file": (DTYPES, "bf16", True),
    }


def test_a_dtype_a_format_does_not_write_names_the_formats_that_do():
    found = formats()
    assert dtype_refusal(found["single-file"], "fp8") is None
    assert dtype_refusal(found["lora"], "fp8") == (
        "--dtype fp8 is for --format single-file (ComfyUI's fp8); LoRA files take --dtype bf16, fp16 or fp32 "
        "(adapters are small: no loader reads fp8 ones)"
    )


def test_a_new_format_is_one_module_with_its_record_and_the_cli_runs_it(finished, tmp_path, monkeypatch):
    from wandistiller import export as export_cli
    from wandistiller.state import formats as package

    plugin = tmp_path / "formats"
    plugin.mkdir()
    (plugin / "notes.py").write_text(
        "from wandistiller.state.formats.base import ExportFormat\n"
        "def write(run, tmp, request):\n"
        "    built = tmp / 'export'\n"
        "    built.mkdir()\n"
        "    (built / 'notes.txt').write_text(f'{run.trained_steps} {request.dtype} {request.checkpoint}')\n"
        "    return built\n"
        "FORMAT = ExportFormat('notes', ('fp32',), 'fp32', 'notes take --dtype fp32', False, lambda run: None, write)\n"
    )
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(plugin)])
    monkeypatch.delitem(sys.modules, "wandistiller.state.formats.notes", raising=False)
    found = formats()
    assert list(found) == ["diffusers", "single-file", "lora", "notes"]  # no order given: after the shipped ones
    monkeypatch.setattr(export_cli, "FORMATS", found)
    out = export_cli.export(finished, tmp_path / "out", "notes")
    assert (out / "notes.txt").read_text() == "None fp32 None"  # a KD student: no K; the format's default dtype
    with refused("--dtype bf16 is for --format diffusers or single-file or lora; notes take --dtype fp32"):
        export_cli.export(finished, tmp_path / "out2", "notes", "bf16")
    with refused("--workflow is for --format single-file or lora (a notes export has no workflow); drop it"):
        export_cli.export(finished, tmp_path / "out3", "notes", workflow="text-to-video")
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


def test_a_request_is_its_defaults_until_asked():
    asked = dataclasses.replace(Request(), dtype="fp16")
    assert (asked.dtype, asked.fp8_layout, asked.checkpoint, dict(asked.phrases)) == ("fp16", "comfy_quant", None, {})
    assert dataclasses.is_dataclass(ExportFormat)
