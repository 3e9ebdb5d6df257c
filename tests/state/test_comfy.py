"""The ComfyUI workflow beside a single file: core nodes, linked slot to slot, at the student's settings."""

from __future__ import annotations

import json

from wandistiller.state.comfy import (
    TEXT_ENCODER,
    VAE,
    Sampling,
    lora_readme,
    readme,
    switch_step,
    teacher_files,
    workflow,
    workflow_text,
)


def by_type(flow: dict) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for node in flow["nodes"]:
        found.setdefault(node["type"], []).append(node)
    return found


def check_links(flow: dict) -> None:
    """Every link joins an existing output slot to an existing input slot, and both ends name it."""
    nodes = {n["id"]: n for n in flow["nodes"]}
    for link_id, source, slot, target, target_slot, kind in flow["links"]:
        assert link_id in nodes[source]["outputs"][slot]["links"] and nodes[source]["outputs"][slot]["type"] == kind
        assert nodes[target]["inputs"][target_slot]["link"] == link_id
    assert flow["last_link_id"] == len(flow["links"]) and flow["last_node_id"] == len(flow["nodes"])


def test_one_file_samples_at_the_students_steps_with_cfg_1_and_the_teachers_shift():
    s = Sampling(4, "euler", "simple", 5.0, 832, 480)
    flow = json.loads(workflow_text(["student.safetensors"], s))
    check_links(flow)
    nodes = by_type(flow)
    assert nodes["UNETLoader"][0]["widgets_values"][0] == "student.safetensors"
    assert nodes["CLIPLoader"][0]["widgets_values"][:2] == [TEXT_ENCODER, "wan"]
    assert nodes["VAELoader"][0]["widgets_values"] == [VAE]
    assert nodes["ModelSamplingSD3"][0]["widgets_values"] == [5.0]
    assert nodes["KSampler"][0]["widgets_values"][2:6] == [4, 1.0, "euler", "simple"]
    assert nodes["EmptyHunyuanLatentVideo"][0]["widgets_values"] == [832, 480, 1, 1]
    assert {"VAEDecode", "SaveImage"} <= set(nodes) and "KSamplerAdvanced" not in nodes


def test_a_pair_hands_over_at_the_boundary_on_comfyuis_schedule():
    s = Sampling(4, "euler", "simple", 3.0, 64, 64, boundary=0.875)
    # simple at shift 3: sigmas 1, 0.9, 0.75, 0.5: the high-noise expert takes the two at or above 0.875
    assert switch_step(s) == 2
    flow = workflow(["x_high_noise.safetensors", "x_low_noise.safetensors"], s, "a red 3")
    check_links(flow)
    high, low = by_type(flow)["KSamplerAdvanced"]
    assert high["widgets_values"][7:9] == [0, 2] and low["widgets_values"][7] == 2
    assert high["widgets_values"][0] == "enable" and low["widgets_values"][0] == "disable"
    assert [n["widgets_values"][0] for n in by_type(flow)["UNETLoader"]] == [
        "x_high_noise.safetensors",
        "x_low_noise.safetensors",
    ]
    text = readme(["x_high_noise.safetensors", "x_low_noise.safetensors"], "x.workflow.json", s, "", "a warning")
    assert "models/diffusion_models" in text and "models/text_encoders" in text and "models/vae" in text
    assert "switching at step 2 of 4" in text and "**Note:** a warning" in text and "cfg 1" in text


def test_a_lora_goes_on_the_teachers_own_file_before_the_sampler_each_expert_its_own():
    s = Sampling(4, "euler", "simple", 5.0, 832, 480, boundary=0.875)
    teacher, known = teacher_files("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan2_2_t2v_a14b", 2)
    assert known and teacher == [
        "wan2.2_t2v_high_noise_14B_fp16.safetensors",
        "wan2.2_t2v_low_noise_14B_fp16.safetensors",
    ]
    assert teacher_files(None, "pocket", 1) == (["pocket.safetensors"], False)
    loras = ["l_high_noise.safetensors", "l_low_noise.safetensors"]
    flow = workflow(teacher, s, "a fox", loras)
    check_links(flow)
    nodes = {n["id"]: n for n in flow["nodes"]}
    for i, lora in enumerate(by_type(flow)["LoraLoaderModelOnly"]):
        assert lora["widgets_values"] == [loras[i], 1.0]  # strength 1: the scale it was trained at
        (link,) = [link for link in flow["links"] if link[3] == lora["id"]]
        assert nodes[link[1]]["type"] == "UNETLoader" and nodes[link[1]]["widgets_values"][0] == teacher[i]
        (out,) = lora["outputs"][0]["links"]
        (after,) = [link for link in flow["links"] if link[0] == out]
        assert nodes[after[3]]["type"] == "ModelSamplingSD3"
    assert [n["widgets_values"][3:5] for n in by_type(flow)["KSamplerAdvanced"]] == [[4, 1.0], [4, 1.0]]
    text = lora_readme(loras, teacher, True, "wan2.2", "l.workflow.json", s, "")
    assert "| `l_low_noise.safetensors` | this export | `models/loras/` |" in text
    assert "`wan2.2_t2v_high_noise_14B_fp16.safetensors` | the teacher wan2.2's diffusion model" in text
    assert "LoraLoaderModelOnly at strength 1" in text and "switching at step" in text and "cfg 1" in text


def test_trained_sigmas_no_comfyui_scheduler_gives_are_set_exactly_and_a_pair_splits_them_at_the_boundary():
    from wandistiller.state.comfy import MANUAL, workflow_sigmas

    sigmas = (1.0, 0.92820323, 0.79930055, 0.5, 0.0)  # diffusers' Euler at shift 3, K 4
    s = Sampling(4, "euler", MANUAL, 3.0, 64, 64, boundary=0.875, sigmas=sigmas)
    flow = workflow(["h.safetensors", "l.safetensors"], s, "a red 3")
    check_links(flow)
    nodes = by_type(flow)
    assert workflow_sigmas(flow) == list(sigmas) and "KSampler" not in nodes and "KSamplerAdvanced" not in nodes
    assert nodes["SplitSigmas"][0]["widgets_values"] == [2] == [switch_step(s)]  # .928 >= .875 > .799
    high, low = nodes["SamplerCustomAdvanced"]
    ids = {n["id"]: n for n in flow["nodes"]}
    source = {link[0]: ids[link[1]]["type"] for link in flow["links"]}
    assert [source[i["link"]] for i in high["inputs"]] == [
        "RandomNoise", "BasicGuider", "KSamplerSelect", "SplitSigmas", "EmptyHunyuanLatentVideo"
    ]  # fmt: skip
    assert [source[i["link"]] for i in low["inputs"]][::4] == ["DisableNoise", "SamplerCustomAdvanced"]
    text = readme(["h.safetensors", "l.safetensors"], "x.workflow.json", s, "", None)
    assert "ManualSigmas" in text and "SplitSigmas and two SamplerCustomAdvanced, switching at step 2 of 4" in text
