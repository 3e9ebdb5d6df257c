"""The pocket teacher: a small Wan text-to-image model trained here on real images that ship in the package.

`teacher=pocket` (one transformer) and `teacher=pocket_moe` (two experts at Wan 2.2's boundary) are complete
diffusers Wan folders under `wandistiller/assets/pocket/`, loaded through the same `from_pretrained` path as a
downloaded Wan model. `python -m wandistiller.pocket.build` rebuilds them (and the judge classifier and the
training images) from the shipped digits, reproducibly on one kind of CPU: the float kernels torch picks differ
by instruction set (AVX-512, AVX2), so another CPU trains a teacher as good, not the same bytes (docs/QUALITY.md).
"""

from pathlib import Path

POCKET_DIR = Path(__file__).resolve().parents[1] / "assets" / "pocket"
TEACHER_DIR = POCKET_DIR / "pocket-wan-t2v"
MOE_TEACHER_DIR = POCKET_DIR / "pocket-wan-t2v-moe"
TRAIN_IMAGES_DIR = POCKET_DIR / "digits_train"  # a `datasets` folder (save_to_disk): image, text
VIDEO_TEACHER_DIR = POCKET_DIR / "pocket-wan-t2v-video"  # teacher=pocket_video: 9 frames of 32x32, 5 latent frames
VIDEO_MOE_TEACHER_DIR = POCKET_DIR / "pocket-wan-t2v-video-moe"
FRAME_CLASSIFIER_FILE = POCKET_DIR / "frame_classifier.safetensors"  # the video teacher's frame judge
VIDEO_PROMPTS_FILE = POCKET_DIR / "video_prompts.txt"
I2V_TEACHER_DIR = POCKET_DIR / "pocket-wan-i2v"  # teacher=pocket_i2v: the video teacher given its first frame
I2V_MOE_TEACHER_DIR = POCKET_DIR / "pocket-wan-i2v-moe"  # Wan 2.2 I2V A14B's layout: two experts, no image encoder
I2V_PAIRS_DIR = POCKET_DIR / "i2v_pairs"  # a `datasets` folder (image, text): one first frame per video prompt
