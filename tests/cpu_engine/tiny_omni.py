"""The tiny Qwen2.5-Omni thinker the real-engine tier serves: random weights, nothing downloaded.

vllm-omni serves it as pipeline ``qwen2_5_omni_thinker_only`` (audio, image and video in, text out).
Everything comes from the installed transformers and tokenizers: a byte-level BPE tokenizer trained
here on a few words with Qwen2.5-Omni's special tokens, Qwen2.5-Omni's processor over small image,
video and Whisper feature processors, and the thinker's weights from HF's own module, randomly
initialised and saved with the ``thinker.`` prefix a full checkpoint has.

Sizes that matter: vLLM's CPU attention kernels take head sizes of 32 and up, so the text model has
hidden 128 over 4 heads; a 56x56 image is 4 image tokens; 1 s of 16 kHz audio is a few dozen. Random
weights never emit EOS: a good answer ends at max_tokens (finish_reason "length").

usage: python tests/cpu_engine/tiny_omni.py OUT_DIR   (run in the real-engine environment)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                  "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                  "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>",
                  "<|vision_start|>", "<|vision_end|>"]
CORPUS = ("hello world describe the image audio what is in this picture sound user assistant system "
          "transcribe briefly " + " ".join("abcdefghijklmnopqrstuvwxyz0123456789"))
VOCAB_SIZE = 640  # the model's embedding rows: at least the tokenizer's vocabulary, a multiple of 64
# One placeholder per media item; the processor expands it to the item's token count.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('audio', 'audio_url', 'input_audio') %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif c['type'] in ('image', 'image_url') %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif c['type'] in ('video', 'video_url') %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROPE = {"rope_type": "default", "rope_theta": 1000000.0}


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([CORPUS] * 8, trainer=trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _thinker_config(ids: dict[str, int], user_id: int) -> dict:
    specials = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                "pad_token_id": ids["<|endoftext|>"]}
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_parameters={**ROPE, "mrope_section": [4, 6, 6]}, **specials)
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "in_channels": 3, "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": 128,
                  "fullatt_block_indexes": [1]}
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128, "d_model": 64,
                 "max_source_positions": 1500, "n_window": 100, "output_dim": 128}
    return dict(text_config=text, vision_config=vision, audio_config=audio,
                audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
                video_token_index=ids["<|VIDEO|>"], audio_start_token_id=ids["<|audio_bos|>"],
                audio_end_token_id=ids["<|audio_eos|>"], vision_start_token_id=ids["<|vision_bos|>"],
                vision_end_token_id=ids["<|vision_eos|>"], user_token_id=user_id, **specials)


def build(out: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni import Qwen2_5OmniProcessor
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniThinkerConfig,
    )
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    vocab = tok.get_vocab()
    if len(vocab) > VOCAB_SIZE:
        raise SystemExit(f"tokenizer vocabulary {len(vocab)} > VOCAB_SIZE {VOCAB_SIZE}")
    pixels = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}
    Qwen2_5OmniProcessor(image_processor=Qwen2VLImageProcessor(**pixels),
                         video_processor=Qwen2VLVideoProcessor(**pixels),
                         feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000),
                         tokenizer=tok, chat_template=CHAT_TEMPLATE).save_pretrained(str(out))
    tok.save_pretrained(str(out))

    ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    thinker = _thinker_config(ids, vocab.get("user", 0))
    # The talker is configured (Qwen2.5-Omni's config requires it) but has no weights: the
    # thinker-only pipeline never loads it.
    talker = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, embedding_size=64, head_dim=16,
                  rope_parameters={**ROPE, "mrope_section": [2, 3, 3]},
                  **{k: thinker[k] for k in ("audio_token_index", "image_token_index", "video_token_index",
                                             "vision_start_token_id", "vision_end_token_id",
                                             "audio_start_token_id", "audio_end_token_id")})
    cfg = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, enable_audio_output=False)
    cfg.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    cfg.save_pretrained(str(out))

    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(Qwen2_5OmniThinkerConfig(**thinker)).to(torch.float32)
    weights = {f"thinker.{k}": v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"]}, indent=1))
    params = sum(v.numel() for v in weights.values())
    print(f"tiny Qwen2.5-Omni thinker in {out}: {len(weights)} tensors, {params:,} parameters, "
          f"vocabulary {len(vocab)}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    build(Path(sys.argv[1]))
