"""The tiny Qwen3-Omni the speech pipeline (``qwen3_omni_moe``: thinker -> talker -> code2wav) serves:
random weights, nothing downloaded, every tensor from a seed.

vllm-omni 0.30.0 hard-codes Qwen token ids (im_start 151644, user 872, assistant 77091, system 8948,
audio/tts specials 151669..151675, codec codebook 2048), so the tokenizer puts its tokens at those
ids (filler tokens in between) and the thinker keeps the real vocabulary size (152064). The thinker's
vision config carries ``image_size`` and ``apply_vit_abs_pos_embed``: vllm-omni's thinker reads both
and transformers' config does not write them by default. About 47 M parameters, built in ~15 s.

Deterministic: HF's initialisers leave some tensors as torch.empty, so after construction every
parameter is re-drawn from a generator seeded by (SEED, its name): norms 1, biases 0, the rest N(0, 0.02).

usage: python tests/cpu_engine/tiny_qwen3_omni.py OUT_DIR   (run in the real-engine environment)
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

SEED = 0

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                 "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                 "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
                 "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"]
FIRST_SPECIAL = 151643
ROLE_IDS = {"user": 872, "system": 8948, "assistant": 77091}
CORPUS = ("hello world say describe the image audio what is in this picture sound user assistant system "
          "transcribe briefly one sentence " + " ".join("abcdefghijklmnopqrstuvwxyz0123456789"))
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('audio', 'audio_url', 'input_audio') %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator([CORPUS, "user", "assistant", "system"] * 8, trainer=trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    spec = json.loads(t.to_str())
    trained = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab, free = {}, (i for i in range(FIRST_SPECIAL) if i not in ROLE_IDS.values())
    for tok, _ in trained:
        vocab[tok] = ROLE_IDS[tok] if tok in ROLE_IDS else next(free)
    missing = set(ROLE_IDS) - set(vocab)
    assert not missing, f"roles not single tokens: {missing}"
    used = set(vocab.values())
    for i in range(FIRST_SPECIAL):       # fillers: every id below the specials decodes to something
        if i not in used:
            vocab[f"<f{i}>"] = i
    spec["model"]["vocab"] = vocab
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(QWEN_SPECIALS)
    assert backend.token_to_id("<|im_start|>") == 151644 and backend.token_to_id("<|audio_pad|>") == 151675
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>",
                              "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
                              "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
                              "audio_eos_token": "<|audio_end|>"})
    tok.chat_template = CHAT_TEMPLATE
    return tok


VISION_KEYS_THE_THINKER_READS = ("image_size", "apply_vit_abs_pos_embed")


def config() -> dict:
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6],
             "interleaved": True, "mrope_interleaved": True}
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1}
    text = dict(vocab_size=152064, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_parameters=mrope, norm_topk_prob=True, tie_word_embeddings=False, **moe)
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "in_channels": 3, "patch_size": 16,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 128, "num_position_embeddings": 2304, "image_size": 768, "apply_vit_abs_pos_embed": True,
                  "deepstack_visual_indexes": [1]}
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128, "d_model": 64,
                 "output_dim": 128, "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500, "downsample_hidden_size": 32,
                 "max_source_positions": 1500}
    media = {"audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656, "audio_start_token_id": 151669,
                 "vision_start_token_id": 151652}
    thinker = dict(text_config=text, vision_config=vision, audio_config=audio, audio_end_token_id=151670,
                   vision_end_token_id=151653, position_id_per_seconds=13, seconds_per_chunk=2, user_token_id=872,
                   **media)
    talker = dict(
        text_config=dict(vocab_size=3072, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, rope_parameters=mrope, shared_expert_intermediate_size=64,
                         norm_topk_prob=False, **moe),
        code_predictor_config={"vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                                   "max_position_embeddings": 4096, "num_code_groups": 16,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        num_code_groups=16, thinker_hidden_size=128, accept_hidden_layer=1, codec_eos_token_id=2150,
        codec_pad_id=2148, codec_bos_id=2149, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
        speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303}, position_id_per_seconds=13, spatial_merge_size=2, **media)
    code2wav = {"codebook_size": 2048, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
                    "num_hidden_layers": 1, "intermediate_size": 128, "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3],
                    "upsampling_ratios": [2, 2], "decoder_dim": 64, "sliding_window": 72, "max_position_embeddings": 8000}
    return {"thinker_config": thinker, "talker_config": talker, "code2wav_config": code2wav, "enable_audio_output": True,
                "im_start_token_id": 151644, "im_end_token_id": 151645, "tts_pad_token_id": 151671, "tts_bos_token_id": 151672,
                "tts_eos_token_id": 151673, "system_token_id": 8948, "user_token_id": 872, "assistant_token_id": 77091}


def _seeded_(model) -> None:
    """Every parameter from (SEED, its name): the same bytes on every build, whatever HF leaves empty."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                g = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.02)


def build(out: Path) -> Path:
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeForConditionalGeneration,
        WhisperFeatureExtractor,
    )
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeProcessor

    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    pixels = {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 16, "patch_size": 16}
    Qwen3OmniMoeProcessor(image_processor=Qwen2VLImageProcessor(**pixels),
                          video_processor=Qwen2VLVideoProcessor(**pixels),
                          feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000),
                          tokenizer=tok, chat_template=CHAT_TEMPLATE).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    cfg = Qwen3OmniMoeConfig(**config())
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = Qwen3OmniMoeForConditionalGeneration(cfg).to(torch.float32)
    _seeded_(model)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg.save_pretrained(str(out))
    # save_pretrained drops keys equal to the class defaults; the thinker reads these two.
    path = out / "config.json"
    saved = json.loads(path.read_text())
    vision = saved["thinker_config"]["vision_config"]
    for key in VISION_KEYS_THE_THINKER_READS:
        vision[key] = config()["thinker_config"]["vision_config"][key]
    path.write_text(json.dumps(saved, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}, indent=1))
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen3-Omni in {out}: {n:,} parameters (seed {SEED})")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    build(Path(sys.argv[1]))
