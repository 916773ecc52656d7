"""Tiny Hugging Face checkpoint directories without weights, for the tiers that build real vLLM
configs on the CPU: the engine tier (tests/engine), the stand-in head (tests/standin) and the cache
benchmark (tests/bench/bench_cache.py). Nothing is mocked: vLLM's own config, tokenizer, processor
and renderer code load them exactly as they would a downloaded model; nothing loads weights.

Not here: tests/cpu_engine/tiny_omni.py, the Qwen2.5-Omni thinker that real engines serve. It has
random weights and its own tokenizer (Omni's special tokens), runs as a script in the real-engine
environment, and hack/real-engine-env.sh rebuilds the cached model when that one file changes.

transformers and tokenizers are imported by the builders, not here, so that importing this module
reads nothing before the environment vLLM reads at import is set (tests/support/engine_env.py).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = [
    "hello",
    "world",
    "describe",
    "the",
    "image",
    "what",
    "is",
    "in",
    "this",
    "picture",
    "user",
    "assistant",
    "system",
    "a",
    "b",
    "c",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
# A prompt with one image placeholder, for raw (non-chat) prompts.
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|> describe the image"


def tiny_tokenizer() -> tuple[Any, dict[str, int]]:
    """A small byte-level BPE tokenizer (the Qwen2 tokenizer family's scheme), trained here, and its
    vocabulary.

    transformers maps qwen2 / qwen2_vl checkpoints to `Qwen2Tokenizer`, which re-applies its own
    byte-level pre-tokenizer; a byte-level BPE vocabulary (all 256 byte symbols) round-trips
    through it, a word-level one would not.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([" ".join(WORDS)] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer, backend.get_vocab()


def text_config(vocab_size: int) -> dict[str, Any]:
    """The tiny Qwen2 text model every checkpoint here shares (one layer, hidden size 64)."""
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "num_key_value_heads": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
        "tie_word_embeddings": True,
    }


def build_tiny_multimodal_model(out: Path) -> Path:
    """A Qwen2-VL-architecture checkpoint directory without weights (tiny image processor)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    out.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = tiny_tokenizer()
    # 56x56 images become 4x4 patches of 14 px: small tensors, fast processing on the CPU.
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        **text_config(len(vocab)),
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
        "vision_config": {
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "in_chans": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "mlp_ratio": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def build_tiny_text_model(out: Path) -> Path:
    """A Qwen2 (text-only) checkpoint directory without weights."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = tiny_tokenizer()
    tokenizer.save_pretrained(str(out))
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **text_config(len(vocab))}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def build_config_only_model(directory: Path | None = None) -> Path:
    """A text-only Qwen2 config directory without weights or tokenizer (the stand-in head never runs
    it; a fresh temporary directory when none is given).

    vLLM's ``ModelConfig`` reads only ``config.json`` when ``skip_tokenizer_init`` is set, which
    is all the stat logger needs (served model name, max model length).
    """
    directory = Path(directory or tempfile.mkdtemp(prefix="omnistage-standin-model-"))
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **text_config(256)}
    (directory / "config.json").write_text(json.dumps(config))
    return directory
