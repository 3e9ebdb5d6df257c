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
    from tests.conftest import workflow_sigmas
    from wandistiller.state.comfy import MANUAL

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


def sources_of(flow: dict, node: dict) -> dict[str, tuple[str, int]]:
    """Each linked input of `node`: (the type of the node it comes from, that node's output slot)."""
    ids = {n["id"]: n for n in flow["nodes"]}
    links = {link[0]: link for link in flow["links"]}
    return {i["name"]: (ids[links[i["link"]][1]]["type"], links[i["link"]][2]) for i in node["inputs"]}


def test_wan21_i2v_gives_its_first_frame_and_clip_tokens_through_wan_image_to_video():
    from wandistiller.state.comfy import CLIP_VISION, FIRST_FRAME, WAN_I2V

    s = Sampling(4, "euler", "simple", 3.0, 832, 480, frames=81, image_node=WAN_I2V, first_frame=True, clip_vision=True)
    flow = workflow(["wan2.1_i2v_480p_14B_fp16.safetensors"], s, "a fox", ["l.safetensors"])
    check_links(flow)
    nodes = by_type(flow)
    assert nodes["LoadImage"][0]["widgets_values"] == [FIRST_FRAME, "image"]
    assert nodes["CLIPVisionLoader"][0]["widgets_values"] == [CLIP_VISION]
    assert sources_of(flow, nodes["CLIPVisionEncode"][0]) == {"clip_vision": ("CLIPVisionLoader", 0),
                                                              "image": ("LoadImage", 0)}  # fmt: skip
    (i2v,) = nodes[WAN_I2V]
    assert i2v["widgets_values"] == [832, 480, 81, 1]  # width, height, length, batch size
    assert sources_of(flow, i2v) == {
        "positive": ("CLIPTextEncode", 0),
        "negative": ("CLIPTextEncode", 0),
        "vae": ("VAELoader", 0),
        "clip_vision_output": ("CLIPVisionEncode", 0),
        "start_image": ("LoadImage", 0),
    }
    # The sampler takes the image-conditioned prompts and WanImageToVideo's latent, never an empty one of its own.
    assert sources_of(flow, nodes["KSampler"][0]) == {
        "model": ("ModelSamplingSD3", 0),
        "positive": (WAN_I2V, 0),
        "negative": (WAN_I2V, 1),
        "latent_image": (WAN_I2V, 2),
    }
    assert "EmptyHunyuanLatentVideo" not in nodes and "SaveAnimatedWEBP" in nodes and "SaveImage" not in nodes
    text = lora_readme(["l.safetensors"], ["wan2.1_i2v_480p_14B_fp16.safetensors"], True, "wan", "w.json", s, "")
    assert f"| `{CLIP_VISION}` |" in text and "`models/clip_vision/`" in text and "81 frames" in text
    assert "pick it in the workflow's Load Image node" in text


def test_an_i2v_pair_at_its_trained_sigmas_guides_both_experts_with_the_image_conditioned_prompt():
    from tests.conftest import workflow_sigmas
    from wandistiller.state.comfy import MANUAL, WAN_I2V, teacher_files

    sigmas = (1.0, 0.92820323, 0.79930055, 0.5, 0.0)
    s = Sampling(4, "euler", MANUAL, 3.0, 64, 64, 0.9, sigmas=sigmas, frames=5, image_node=WAN_I2V, first_frame=True)
    teacher, known = teacher_files("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "x", 2)
    assert known and teacher == [
        "wan2.2_i2v_high_noise_14B_fp16.safetensors",
        "wan2.2_i2v_low_noise_14B_fp16.safetensors",
    ]
    flow = workflow(teacher, s, "a fox", ["l_high_noise.safetensors", "l_low_noise.safetensors"])
    check_links(flow)
    nodes = by_type(flow)
    assert workflow_sigmas(flow) == list(sigmas) and "CLIPVisionEncode" not in nodes  # A14B: no image encoder
    assert [sources_of(flow, g)["conditioning"] for g in nodes["BasicGuider"]] == [(WAN_I2V, 0)] * 2
    high, low = nodes["SamplerCustomAdvanced"]
    assert sources_of(flow, high)["latent_image"] == (WAN_I2V, 2)
    assert sources_of(flow, low)["latent_image"] == ("SamplerCustomAdvanced", 0)


def test_ti2v_takes_its_first_frame_as_its_latents_first_frame_or_makes_a_clip_from_text_alone():
    from wandistiller.state.comfy import VAE_22, WAN22_I2V, workflow_problem

    for given in (True, False):
        s = Sampling(4, "euler", "simple", 5.0, 64, 64, frames=5, image_node=WAN22_I2V, first_frame=given, vae=VAE_22)
        flow = workflow(["wan2.2_ti2v_5B_fp16.safetensors"], s, "a fox")
        check_links(flow)
        nodes = by_type(flow)
        (latent,) = nodes[WAN22_I2V]
        assert latent["widgets_values"] == [64, 64, 5, 1] and nodes["VAELoader"][0]["widgets_values"] == [VAE_22]
        expected = {"vae": ("VAELoader", 0)} | ({"start_image": ("LoadImage", 0)} if given else {})
        assert sources_of(flow, latent) == expected and ("LoadImage" in nodes) == given
        assert sources_of(flow, nodes["KSampler"][0])["latent_image"] == (WAN22_I2V, 0)
        assert sources_of(flow, nodes["KSampler"][0])["positive"] == ("CLIPTextEncode", 0)
    assert workflow_problem("ti2v", "text-to-video") is None and workflow_problem("ti2v", "image-to-video") is None
    assert "a text-to-video workflow has no image" in workflow_problem("i2v", "text-to-video")
    assert "experts take no image" in workflow_problem("t2v", "image-to-video")
