"""Llama / Qwen2 / Qwen3 decoder (Flax NNX), its KV cache, and Hugging Face interop."""

from rlflow.models.config import DecoderConfig, ModelFormatError, SUPPORTED_MODEL_TYPES
from rlflow.models.decoder import (Decoder, TokenRangeError, positions_from_mask,
                                   validate_tokens)
from rlflow.models.hf import build_model, load_hf, save_hf, write_hf
from rlflow.models.kv_cache import KVCache, init_cache

__all__ = ["DecoderConfig", "ModelFormatError", "SUPPORTED_MODEL_TYPES", "Decoder",
           "TokenRangeError", "positions_from_mask", "validate_tokens", "build_model",
           "load_hf", "save_hf", "write_hf", "KVCache", "init_cache"]
