"""The tiny model families of tiny_vlm.py other than Qwen's, each a random-init member of
an architecture vLLM users run with EPD, with its own vision tower, projector and image
prompt layout (tiny_vlm.py's tokenizer with the family's special tokens and a chat
template in the family's style):

  llava     LLaVA-1.5: a CLIP vision tower, a 2-layer MLP projector, a Llama LM; an image
            is 112x112 px, 64 tokens (<image> repeated).
  gemma3    Gemma 3: a SigLIP vision tower, average-pooled to 16 tokens per image, a
            Gemma 3 LM (sliding-window and global layers); <start_of_image>, the soft
            tokens, <end_of_image>, between blank lines (runs of newlines are tokens).
  idefics3  Idefics3: a SigLIP-style vision tower with pixel-shuffle, a Llama LM; an image
            is split into 2x2 tiles plus a global view, each tile's 4 tokens after its
            <row_i_col_j> tag between <fake_token_around_image> markers, so only part of an
            image's placeholder is its embedding (vLLM's is_embed).

Imported by tiny_vlm.build; like it, this file imports neither ecx nor its C++ extension."""
from __future__ import annotations

from tiny_vlm import GEOMETRIES, finish, save_model, train_tokenizer

LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': ' }}{% endif %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>\n' }}{% elif item['type'] == 'text' %}"
    "{{ item['text'] }}{% endif %}{% endfor %}{% endif %}{% if message['role'] != 'assistant' %}"
    "{{ '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "<start_of_turn>{{ role }}\n{% if message['content'] is string %}"
    "{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}"
    "{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
IDEFICS3_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}"
    "{% elif item['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

QWEN2_AUDIO_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)

VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
IMAGE_SIDE = 112
PATCH = 14


def _llama(g: dict, vocab_size: int, ids: dict) -> dict:
    return dict(model_type="llama", vocab_size=vocab_size, hidden_size=g["hidden_size"],
                intermediate_size=g["intermediate_size"], num_hidden_layers=g["num_layers"],
                num_attention_heads=g["num_heads"], num_key_value_heads=g["num_kv_heads"],
                max_position_embeddings=g["max_position_embeddings"], rms_norm_eps=1e-6,
                tie_word_embeddings=False, dtype="bfloat16", **ids)


def vision_model_as_released(tensors: dict) -> dict:
    """The vision tower's weights under vision_tower.vision_model., as released CLIP and
    SigLIP towers (and vLLM) name them; transformers stores them without that level."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        out[name] = tensor
    return out


def language_model_as_released(tensors: dict) -> dict:
    """The language model under language_model.model. (one level, as Qwen2-Audio's
    release has it); transformers stores it one level deeper."""
    prefix = "language_model.model.model."
    return {("language_model.model." + n[len(prefix):] if n.startswith(prefix) else n): t
            for n, t in tensors.items()}


AS_RELEASED = {"llava": vision_model_as_released, "gemma3": vision_model_as_released,
               "qwen2-audio": language_model_as_released}


def _vocab(tokenizer) -> int:
    return (len(tokenizer) + 63) // 64 * 64


def _llava(g: dict):
    import transformers as tf

    tok = train_tokenizer(["<s>", "</s>", "<pad>", "<image>"], eos="</s>", pad="<pad>",
                          bos="<s>", chat_template=LLAVA_TEMPLATE,
                          named={"image_token": "<image>"})
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(image_size=IMAGE_SIDE, patch_size=PATCH,
                                          projection_dim=64, hidden_act="quick_gelu", **VISION),
        text_config=_llama(g, _vocab(tok), ids),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(IMAGE_SIDE // PATCH) ** 2, **ids)
    image = tf.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIDE},
                                  crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    processor = tf.LlavaProcessor(image_processor=image, tokenizer=tok, patch_size=PATCH,
                                  vision_feature_select_strategy="default",
                                  chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1)
    return config, tf.LlavaForConditionalGeneration, tok, processor, image, ids


def _gemma3(g: dict):
    import transformers as tf

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>"}
    tok = train_tokenizer(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                           *named.values()], eos="<end_of_turn>", pad="<pad>", bos="<bos>",
                          chat_template=GEMMA3_TEMPLATE, named=named,
                          # Gemma's vocabulary has runs of newlines as tokens; vLLM's
                          # Gemma 3 processing looks them up.
                          plain=["\n", "\n\n", "\n\n\n", "\n\n\n\n"])
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    tokens_per_image = 16  # the 8x8 patches pooled 2x2
    head_dim = g["hidden_size"] // g["num_heads"]
    text = tf.Gemma3TextConfig(
        vocab_size=_vocab(tok), hidden_size=g["hidden_size"],
        intermediate_size=g["intermediate_size"], num_hidden_layers=g["num_layers"],
        num_attention_heads=g["num_heads"], num_key_value_heads=g["num_kv_heads"],
        head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=512,
        layer_types=["sliding_attention", "full_attention"] * (g["num_layers"] // 2),
        max_position_embeddings=g["max_position_embeddings"],
        dtype="bfloat16", **ids)
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=tf.SiglipVisionConfig(image_size=IMAGE_SIDE, patch_size=PATCH,
                                            vision_use_head=False, **VISION),
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=tok.convert_tokens_to_ids(named["boi_token"]),
        eoi_token_index=tok.convert_tokens_to_ids(named["eoi_token"]),
        image_token_index=tok.convert_tokens_to_ids(named["image_token"]), **ids)
    image = tf.Gemma3ImageProcessor(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE},
                                    do_pan_and_scan=False)
    processor = tf.Gemma3Processor(image_processor=image, tokenizer=tok,
                                   chat_template=GEMMA3_TEMPLATE,
                                   image_seq_length=tokens_per_image)
    return config, tf.Gemma3ForConditionalGeneration, tok, processor, image, ids


def _idefics3(g: dict):
    import transformers as tf

    tile, scale = 56, 2  # each tile: 4x4 patches, pixel-shuffled 2x2 to 4 tokens
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok = train_tokenizer(["<|begin_of_text|>", "<|end_of_text|>", "<end_of_utterance>",
                           "<pad>", "<fake_token_around_image>", "<image>", "<global-img>",
                           *grid], eos="<end_of_utterance>", pad="<pad>",
                          bos="<|begin_of_text|>", chat_template=IDEFICS3_TEMPLATE,
                          named={"image_token": "<image>"})
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    config = tf.Idefics3Config(
        vision_config=dict(image_size=tile, patch_size=PATCH, **VISION),
        text_config=_llama(g, _vocab(tok), ids), scale_factor=scale,
        image_token_id=tok.convert_tokens_to_ids("<image>"), **ids)
    image = tf.Idefics3ImageProcessor(size={"longest_edge": 2 * tile},
                                      max_image_size={"longest_edge": tile})
    processor = tf.Idefics3Processor(image_processor=image, tokenizer=tok,
                                     image_seq_len=(tile // PATCH) ** 2 // scale ** 2,
                                     chat_template=IDEFICS3_TEMPLATE)
    return config, tf.Idefics3ForConditionalGeneration, tok, processor, image, ids


def _qwen2_audio(g: dict):
    import transformers as tf

    named = {"audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>",
             "audio_eos_token": "<|audio_eos|>"}
    tok = train_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *named.values()],
                          eos="<|im_end|>", pad="<|endoftext|>",
                          chat_template=QWEN2_AUDIO_TEMPLATE, named=named)
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(model_type="qwen2", vocab_size=_vocab(tok), hidden_size=g["hidden_size"],
                intermediate_size=g["intermediate_size"], num_hidden_layers=g["num_layers"],
                num_attention_heads=g["num_heads"], num_key_value_heads=g["num_kv_heads"],
                max_position_embeddings=g["max_position_embeddings"], rms_norm_eps=1e-6,
                tie_word_embeddings=False, dtype="bfloat16", **ids)
    # A Whisper-style encoder: 128 mel bins, 30 s windows (3000 frames, 1500 positions),
    # pooled 2x: 25 tokens per second of audio.
    config = tf.Qwen2AudioConfig(
        audio_config=dict(d_model=64, encoder_layers=2, encoder_attention_heads=2,
                          encoder_ffn_dim=128, num_mel_bins=128, max_source_positions=1500),
        text_config=text, audio_token_index=tok.convert_tokens_to_ids(named["audio_token"]),
        **ids)
    features = tf.WhisperFeatureExtractor(feature_size=128, sampling_rate=16000,
                                          hop_length=160, chunk_length=30, n_fft=400,
                                          return_attention_mask=True)
    processor = tf.Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok,
                                       chat_template=QWEN2_AUDIO_TEMPLATE)
    return config, tf.Qwen2AudioForConditionalGeneration, tok, processor, features, ids


BUILDERS = {"llava": _llava, "gemma3": _gemma3, "idefics3": _idefics3,
            "qwen2-audio": _qwen2_audio}


def build(out_dir: str, geometry: str, seed: int, family: str) -> str:
    from transformers import GenerationConfig

    config, model_class, tokenizer, processor, image, ids = BUILDERS[family](GEOMETRIES[geometry])
    config.architectures = [model_class.__name__]
    save_model(model_class, config, seed, out_dir, as_released=AS_RELEASED.get(family))
    GenerationConfig(do_sample=False, **ids).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    image.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    finish(out_dir)
    return out_dir
