"""Tiny multimodal models for tests and benchmarks, built offline and deterministically.

    python bench/python/tiny_vlm.py OUT_DIR [--family F] [--geometry tiny|seed] [--seed N]

writes a random-init model of one architecture family (transformers' model class built
from a config: model code only, nothing from a hub) that `vllm serve OUT_DIR` loads:
config.json, generation_config.json, model.safetensors (bf16, in the layout the family's
released checkpoints have), a byte-level BPE tokenizer trained here with the `tokenizers`
library on the fixed text below (with the family's special tokens and a chat template in
its style), and the processor files.

Families (--family; tiny_vlm_families.py holds all but Qwen's VL ones):
  qwen2-vl      Qwen2-VL (the default): 14 px patches, merged 2x2
  qwen2.5-vl    Qwen2.5-VL: windowed vision attention
  qwen3-vl      Qwen3-VL: 16 px patches, DeepStack (encoder items 3x the LM's width)
  qwen3-vl-moe  Qwen3-VL-MoE: as Qwen3-VL with a mixture-of-experts language model
  llava         LLaVA-1.5 (CLIP + MLP projector)
  gemma3        Gemma 3 (SigLIP, pooled)
  idefics3      Idefics3 (tiles with row/column tags)
  qwen2-audio   Qwen2-Audio (a Whisper-style audio encoder)

Geometries of the Qwen VL families (both: 2 LM layers, 2 vision blocks, 2x2 merge; the
other families use the language model of the geometry and a tower of their own):
  tiny  hidden 256, vision width 64; every image is resized to about 112x112 pixels
        (128 for Qwen3-VL), 16 image tokens.
  seed  hidden 2048, vision width 128; every image is resized to about 560x560 pixels,
        400 image tokens, so an encoder-cache item is 400 x 2048 bf16 = 1600 KiB.
The processor's min_pixels = max_pixels (the "shortest_edge" / "longest_edge" of its size),
so every image, whatever its size, costs the same number of tokens (exactly for a square
image, about that for others).

The same --seed gives byte-identical files (weights from torch's CPU generator; the
tokenizer trained on a fixed text). This file imports neither ecx nor its C++ extension,
so it also runs as a plain script where ecx is not built. Needs torch, transformers,
tokenizers, safetensors (all in vLLM's closure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The model families (each a tiny random member of an architecture vLLM serves):
QWEN_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")
FAMILIES = QWEN_FAMILIES + ("llava", "gemma3", "idefics3", "qwen2-audio")

GEOMETRIES = {
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
        vision_depth=2, vision_embed_dim=64, vision_heads=2, vision_mlp_ratio=2,
        image_side=112, max_position_embeddings=4096,
    ),
    "seed": dict(
        hidden_size=2048, intermediate_size=2048, num_layers=2, num_heads=16, num_kv_heads=2,
        vision_depth=2, vision_embed_dim=128, vision_heads=2, vision_mlp_ratio=2,
        image_side=560, max_position_embeddings=8192,
    ),
}

PATCH_SIZE = 14
QWEN3_PATCH_SIZE = 16  # Qwen3-VL's (its images are resized to multiples of 32 px)
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2

# Qwen2-VL's special tokens, in Qwen2-VL's order (there they are ids 151643..151656; here
# they follow the trained vocabulary).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL-Instruct's chat template, verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The tokenizer's training text: fixed, so the vocabulary and merges are too.
TRAINING_TEXT = """\
You are a helpful assistant. Describe the image. What is in this picture? What color is
the square in the top left corner? How many objects are there, and where are they? Compare
the first image with the second one. The quick brown fox jumps over the lazy dog. Pack my
box with five dozen liquor jugs. Sphinx of black quartz, judge my vow. How vexingly quick
daft zebras jump! The five boxing wizards jump quickly.
A picture shows a red circle, a green triangle and a blue square on a white background. The
photo was taken in the morning; the sky is clear and the light is soft. There are two cats
on the sofa and a dog on the floor. The text on the sign says "open from 9 to 17".
Encoder outputs are cached and transferred between the encode instance and the prefill and
decode instance, so the image is encoded once. Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100
128 256 400 512 1024 2048 4096. Punctuation: , . ; : ! ? ( ) [ ] { } < > / \\ | - _ + = * & ^
% $ # @ ~ ` ' ". The answer is yes. The answer is no. I don't know. It's a small model with
random weights: its answers mean nothing, but they are the same every time.
def main(argv):\n    return 0\n
{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "hello"}]}
"""


def train_tokenizer(special_tokens=SPECIAL_TOKENS, eos="<|im_end|>", pad="<|endoftext|>",
                    bos=None, chat_template=CHAT_TEMPLATE, named=None, plain=()):
    """A Qwen2-style byte-level BPE (Qwen2's pre-tokenizer regex) trained on TRAINING_TEXT,
    as a transformers Qwen2Tokenizer with `special_tokens` after the vocabulary (by default
    Qwen2-VL's, its eos, pad and chat template); `named`: the special tokens a family's
    processor finds by attribute (image_token, ...); `plain`: ordinary tokens added after
    them (matched whole, as a family's own vocabulary has them)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    lines = TRAINING_TEXT.splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    model = json.loads(tok.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]

    qtok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=None,
        pad_token=None,
        errors="replace",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    # Added in this order first, so their ids follow the vocabulary in Qwen2-VL's order;
    # then named as eos/pad (Qwen2-VL-Instruct: eos <|im_end|>, pad <|endoftext|>, no bos).
    qtok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    qtok.eos_token = eos
    qtok.pad_token = pad
    if bos is not None:
        qtok.bos_token = bos
    if named:  # saved in tokenizer_config.json as extra_special_tokens
        qtok._set_model_specific_special_tokens(special_tokens=dict(named))
    qtok.chat_template = chat_template
    ids = qtok.convert_tokens_to_ids(list(special_tokens))
    assert ids == list(range(len(vocab), len(vocab) + len(special_tokens))), ids
    if plain:
        qtok.add_tokens(list(plain))
    return qtok


def _qwen_text_config(g: dict, tid: dict, vocab_size: int, interleaved: bool = False) -> dict:
    """The language model of the Qwen VL families at geometry g."""
    head_dim = g["hidden_size"] // g["num_heads"]
    # Multimodal RoPE splits head_dim/2 frequencies 1:1.5:1.5 (t, h, w), as Qwen2-VL's
    # [16, 24, 24] does for head_dim 128 (Qwen3-VL interleaves them, [24, 20, 20]).
    t_sec = head_dim // 8 if not interleaved else head_dim * 3 // 16
    h_sec = (head_dim // 2 - t_sec) // 2
    rope = {"rope_type": "default", "rope_theta": 1000000.0,
            "mrope_section": [t_sec, h_sec, head_dim // 2 - t_sec - h_sec]}
    if interleaved:
        rope["mrope_interleaved"] = True
    return dict(
        vocab_size=vocab_size,
        hidden_size=g["hidden_size"],
        intermediate_size=g["intermediate_size"],
        num_hidden_layers=g["num_layers"],
        num_attention_heads=g["num_heads"],
        num_key_value_heads=g["num_kv_heads"],
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=g["max_position_embeddings"],
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        bos_token_id=tid["<|endoftext|>"],
        eos_token_id=tid["<|im_end|>"],
        pad_token_id=tid["<|endoftext|>"],
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def _qwen_config(family: str, g: dict, tid: dict, vocab_size: int):
    """The transformers config and model class of a Qwen VL family at geometry g."""
    import transformers as tf

    vision = dict(depth=g["vision_depth"], hidden_act="quick_gelu", num_heads=g["vision_heads"],
                  in_channels=3, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
                  temporal_patch_size=TEMPORAL_PATCH_SIZE, dtype="bfloat16")
    text = _qwen_text_config(g, tid, vocab_size, interleaved=family.startswith("qwen3"))
    if family == "qwen2-vl":
        vision.update(embed_dim=g["vision_embed_dim"], mlp_ratio=g["vision_mlp_ratio"],
                      hidden_size=g["hidden_size"])  # the merger's output: the LM's width
        text.pop("head_dim")
        text.update(use_sliding_window=False, max_window_layers=g["num_layers"])
        config_class, model_class = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2.5-vl":
        vision.update(hidden_size=g["vision_embed_dim"], hidden_act="silu",
                      intermediate_size=g["vision_embed_dim"] * g["vision_mlp_ratio"],
                      out_hidden_size=g["hidden_size"], window_size=2 * PATCH_SIZE * MERGE_SIZE,
                      fullatt_block_indexes=[g["vision_depth"] - 1], tokens_per_second=2)
        text.pop("head_dim")
        text.update(use_sliding_window=False, max_window_layers=g["num_layers"])
        config_class, model_class = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    else:  # qwen3-vl, qwen3-vl-moe: 16 px patches; DeepStack features from every block
        vision.update(hidden_size=g["vision_embed_dim"], hidden_act="gelu_pytorch_tanh",
                      intermediate_size=g["vision_embed_dim"] * g["vision_mlp_ratio"],
                      out_hidden_size=g["hidden_size"], patch_size=QWEN3_PATCH_SIZE,
                      num_position_embeddings=64,
                      deepstack_visual_indexes=list(range(g["vision_depth"])))
        if family == "qwen3-vl":
            config_class, model_class = tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration
        else:
            text.update(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                        moe_intermediate_size=g["intermediate_size"] // 2, norm_topk_prob=True)
            config_class = tf.Qwen3VLMoeConfig
            model_class = tf.Qwen3VLMoeForConditionalGeneration
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=tid["<|image_pad|>"],
        video_token_id=tid["<|video_pad|>"],
        vision_start_token_id=tid["<|vision_start|>"],
        vision_end_token_id=tid["<|vision_end|>"],
        tie_word_embeddings=False,
        bos_token_id=tid["<|endoftext|>"],
        eos_token_id=tid["<|im_end|>"],
        pad_token_id=tid["<|endoftext|>"],
        dtype="bfloat16",
    )
    config.architectures = [model_class.__name__]
    return config, model_class


def _qwen_processor(family: str, g: dict, tokenizer):
    """The image and video processors (every image costs the same tokens: min = max
    pixels), and the processor that holds them."""
    import transformers as tf

    patch = QWEN3_PATCH_SIZE if family.startswith("qwen3") else PATCH_SIZE
    side = g["image_side"] // PATCH_SIZE * patch
    pixels = side * side
    common = dict(patch_size=patch, temporal_patch_size=TEMPORAL_PATCH_SIZE, merge_size=MERGE_SIZE)
    image = tf.Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, **common)
    if family.startswith("qwen3"):
        video = tf.Qwen3VLVideoProcessor(size={"shortest_edge": pixels, "longest_edge": pixels},
                                         **common)
        processor_class = tf.Qwen3VLProcessor
    else:
        video = tf.Qwen2VLVideoProcessor(min_pixels=pixels, max_pixels=pixels, **common)
        processor_class = tf.Qwen2VLProcessor if family == "qwen2-vl" else tf.Qwen2_5_VLProcessor
    processor = processor_class(image_processor=image, tokenizer=tokenizer,
                                video_processor=video, chat_template=CHAT_TEMPLATE)
    return processor, image, video


def save_model(model_class, config, seed: int, out_dir: str, as_released=None) -> None:
    """Initialised in float32 with a fixed seed on the CPU generator, then stored as bf16.
    as_released: rewrites the stored {name: tensor} into the layout the family's released
    checkpoints have (what vLLM reads), where transformers stores another."""
    import torch

    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_class._from_config(config, dtype=torch.float32)
    model = model.to(torch.bfloat16).eval()
    for c in (model.config, *(getattr(model.config, n, None) for n in model.config.sub_configs)):
        if c is not None:
            c.dtype = "bfloat16"
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if as_released is not None:
        from safetensors.torch import load_file, save_file

        path = os.path.join(out_dir, "model.safetensors")
        save_file(as_released(load_file(path)), path, metadata={"format": "pt"})


def experts_as_released(tensors: dict) -> dict:
    """Fused MoE experts as the released checkpoints store them ([experts, hidden, 2 x
    intermediate] and [experts, intermediate, hidden]), not transposed as transformers
    keeps them."""
    for name in tensors:
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    return tensors


def build(out_dir: str, geometry: str = "tiny", seed: int = 0, family: str = "qwen2-vl") -> str:
    """Writes the model directory out_dir (created, or overwritten file by file) and
    returns it."""
    from transformers import GenerationConfig

    if family not in QWEN_FAMILIES:
        import tiny_vlm_families  # the other families (same folder)
        return tiny_vlm_families.build(out_dir, geometry, seed, family)
    g = GEOMETRIES[geometry]
    tokenizer = train_tokenizer()
    tid = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = (len(tokenizer) + 63) // 64 * 64
    config, model_class = _qwen_config(family, g, tid, vocab_size)
    save_model(model_class, config, seed, out_dir,
               as_released=experts_as_released if family.endswith("moe") else None)
    GenerationConfig(
        bos_token_id=tid["<|endoftext|>"],
        eos_token_id=[tid["<|im_end|>"], tid["<|endoftext|>"]],
        pad_token_id=tid["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(out_dir)
    processor, image_processor, video_processor = _qwen_processor(family, g, tokenizer)
    processor.save_pretrained(out_dir)  # processor_config.json (both processors nested)
    # And the per-processor files real checkpoints ship, for readers that look only there
    # (vLLM finds the video processor class in video_preprocessor_config.json).
    image_processor.save_pretrained(out_dir)  # preprocessor_config.json
    video_processor.save_pretrained(out_dir)  # video_preprocessor_config.json
    tokenizer.save_pretrained(out_dir)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    finish(out_dir)
    return out_dir


def finish(out_dir: str) -> None:
    for name in os.listdir(out_dir):  # safetensors leaves its file 0600; all files alike
        os.chmod(os.path.join(out_dir, name), 0o644)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/python/tiny_vlm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=FAMILIES, default="qwen2-vl")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    build(a.out_dir, a.geometry, a.seed, a.family)
    print(a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
