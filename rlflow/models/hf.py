"""Hugging Face interop: load a local HF folder into a :class:`Decoder`, write one back.

Folder layout (transformers' ``save_pretrained``): ``config.json``, ``model.safetensors``
or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, optional
``generation_config.json`` and tokenizer files. HF ``nn.Linear`` weights are
``[out, in]``; rlflow kernels are ``[in, out]`` with heads split out (``q [E, H, D]``,
``o [H, D, E]``), so each tensor is transposed / reshaped through one table
(:func:`hf_weight_map`) that both directions use. The decoder stores its layers stacked
(``layers.attn.q_kernel [L, E, H, D]``, :mod:`rlflow.models.layer_scan`): HF's per-layer
tensors (``model.layers.{i}.``, :data:`LAYER_TENSORS`) are read into slice ``i`` of one
stacked array per parameter, and written from it.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from rlflow.models import hf_settings
from rlflow.models import hf_moe, hf_qwen35
from rlflow.models.hf_moe import moe_layer_tensors
from rlflow.models.config import DecoderConfig, ModelFormatError, eos_token_ids
from rlflow.models.decoder import Decoder
from rlflow.models.layer_pattern import layer_pattern
from rlflow.models.weight_files import (INDEX_FILE, SINGLE_FILE,  # noqa: F401 (re-export)
                                        _write_safetensors, check_weight_files,
                                        save_safetensors)

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some old checkpoints carry
DEFAULT_MAX_SHARD_BYTES = 4 * 1024 ** 3
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

# kinds: how an HF tensor maps to ours (and back)
#   copy:      same layout              ([V, E] embedding, [E] norm scales / bias)
#   linear:    HF [out, in] -> [in, out]
#   in_heads:  HF [N*D, E]  -> [E, N, D] (q/k/v projections)
#   out_heads: HF [E, H*D]  -> [H, D, E] (o projection)
#   heads:     HF [N*D]     -> [N, D]    (q/k/v biases)
#   expert_linear: HF [out, in] -> slice j of [n, in, out] (MoE experts, rlflow.models.hf_moe)


class LayerTensor(NamedTuple):
    """One per-layer tensor: its HF name inside ``model.layers.{i}.``, its parameter path
    inside a :class:`rlflow.models.decoder.Block`, its kind (above), ``at``: the index of
    the tensor inside one layer's array (``()``: the whole array; e.g. ``(e,)`` for expert
    ``e`` of an ``[n_experts, ...]`` kernel) and ``when``: whether a config has it."""
    hf: str
    path: tuple
    kind: str
    at: tuple = ()
    when: Callable[[DecoderConfig], bool] = lambda cfg: True


LAYER_TENSORS: tuple[LayerTensor, ...] = (
    LayerTensor("input_layernorm.weight", ("input_norm", "scale"), "copy"),
    LayerTensor("post_attention_layernorm.weight", ("post_attn_norm", "scale"), "copy"),
    LayerTensor("pre_feedforward_layernorm.weight", ("pre_mlp_norm", "scale"), "copy",
                when=lambda cfg: cfg.gemma_norms),
    LayerTensor("post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), "copy",
                when=lambda cfg: cfg.gemma_norms),
    LayerTensor("self_attn.sinks", ("attn", "sinks"), "copy",
                when=lambda cfg: cfg.attention_sinks),
    *(t for p in ("q", "k", "v") for t in (
        LayerTensor(f"self_attn.{p}_proj.weight", ("attn", f"{p}_kernel"), "in_heads"),
        LayerTensor(f"self_attn.{p}_proj.bias", ("attn", f"{p}_bias"), "heads",
                    when=lambda cfg: cfg.attention_bias))),
    LayerTensor("self_attn.o_proj.weight", ("attn", "o_kernel"), "out_heads"),
    LayerTensor("self_attn.o_proj.bias", ("attn", "o_bias"), "copy", when=lambda cfg: cfg.o_bias),
    LayerTensor("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), "copy",
                when=lambda cfg: cfg.qk_norm),
    LayerTensor("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), "copy",
                when=lambda cfg: cfg.qk_norm),
    *(LayerTensor(f"mlp.{p}_proj.weight", ("mlp", f"{p}_kernel"), "linear",
                  when=lambda cfg: not cfg.is_moe)
      for p in ("gate", "up", "down")),
)
"""The per-layer HF tensors of a decoder block, in file order (the table to extend for a new
kind of block: an entry per tensor, ``at`` for tensors that share one stacked array)."""


def layer_tensors(cfg: DecoderConfig, kind: str = "full_attention") -> list[LayerTensor]:
    """The :data:`LAYER_TENSORS` entries ``cfg``'s blocks of ``kind`` have (a
    ``"linear_attention"`` layer: its DeltaNet's, :mod:`rlflow.models.hf_qwen35`)."""
    fixed = [t for t in LAYER_TENSORS if t.when(cfg)]
    if kind == "linear_attention":
        fixed = [t for t in fixed if t.path[0] != "attn"] + [
            LayerTensor(*e) for e in hf_qwen35.linear_layer_tensors(cfg)]
    if not cfg.is_moe:
        return fixed
    if cfg.expert_biases:
        return fixed + [LayerTensor(*entry) for entry in hf_moe.gpt_oss_layer_tensors()]
    shared = [LayerTensor(*e) for e in hf_qwen35.shared_expert_tensors()
              if cfg.shared_expert_intermediate_size]
    return fixed + shared + [LayerTensor(*entry) for entry in moe_layer_tensors(cfg.num_experts)]


class HfTensor(NamedTuple):
    """One HF tensor of a model: ``name``, the rlflow parameter ``path`` it lives in, its
    ``kind`` and ``index``: where in that parameter (``()``: all of it; ``(i, *at)`` for
    layer ``i`` of the stacked layers, ``[L, ...]``)."""
    name: str
    path: tuple
    kind: str
    index: tuple = ()


def hf_weight_map(cfg: DecoderConfig) -> list[HfTensor]:
    """Every tensor of ``cfg``'s model: the embedding, :func:`layer_tensors` for each layer
    (``model.layers.{i}.`` -> ``("layers", ...)`` at index ``i``), the final norm and an
    untied LM head."""
    m = [HfTensor("model.embed_tokens.weight", ("embed",), "copy")]
    per_kind = {k: layer_tensors(cfg, k) for k in set(cfg.kinds)}
    pattern = layer_pattern(cfg.kinds)
    for i in range(cfg.num_layers):
        # several kinds: layer i is slice j of its kind's stack (rlflow.models.layer_pattern)
        kind, j = pattern.slot(i) if len(pattern.kinds) > 1 else (None, i)
        prefix = ("layers",) if kind is None else ("layers", kind)
        m += [HfTensor(f"model.layers.{i}.{t.hf}", prefix + t.path, t.kind, (j, *t.at))
              for t in per_kind[cfg.kinds[i]]]
    m.append(HfTensor("model.norm.weight", ("final_norm", "scale"), "copy"))
    if not cfg.tie_word_embeddings:
        m.append(HfTensor("lm_head.weight", ("lm_head",), "linear"))
    return m


def _hf_shape(kind: str, shape: tuple) -> tuple:
    if isinstance(kind, hf_qwen35.RowSlice):
        return hf_qwen35.row_slice_hf_shape(kind, shape)
    if kind in hf_moe.INTERLEAVED_KINDS:
        return tuple(shape[:-1]) + (2 * shape[-1],)
    if kind in hf_moe.FUSED_KINDS:
        return hf_moe.fused_hf_shape(kind, shape)
    if kind == "copy":
        return tuple(shape)
    if kind in ("linear", "expert_linear"):
        return (shape[1], shape[0])
    if kind == "in_heads":
        return (shape[1] * shape[2], shape[0])
    if kind == "out_heads":
        return (shape[2], shape[0] * shape[1])
    return (shape[0] * shape[1],)   # heads


def _to_ours(kind: str, a: np.ndarray, shape: tuple) -> np.ndarray:
    if isinstance(kind, hf_qwen35.RowSlice):
        return hf_qwen35.row_slice_to_ours(kind, a, shape)
    if kind in hf_moe.INTERLEAVED_KINDS:
        return np.ascontiguousarray(a[..., hf_moe.INTERLEAVED_KINDS.index(kind)::2])
    if kind in hf_moe.FUSED_KINDS:
        return hf_moe.fused_to_ours(kind, a)
    if kind in ("linear", "expert_linear", "in_heads", "out_heads"):
        a = a.T
    return a.reshape(shape)


def _to_hf(kind: str, a: np.ndarray) -> np.ndarray:
    if isinstance(kind, hf_qwen35.RowSlice):
        return hf_qwen35.row_slice_to_hf(kind, a)
    if kind == "in_heads":
        a = a.reshape(a.shape[0], -1)
    elif kind == "out_heads":
        a = a.reshape(-1, a.shape[-1])
    elif kind == "heads":
        a = a.reshape(-1)
    if kind in ("linear", "expert_linear", "in_heads", "out_heads"):
        a = a.T
    return np.ascontiguousarray(a)


def _get(tree, path):
    for key in path:
        if key not in tree and str(key) in tree:
            key = str(key)
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ------------------------------------------------------------------------------ reading
def read_hf_config(path: str) -> dict:
    """Parsed ``config.json`` of a HF folder.

    Raises:
      ModelFormatError: the folder does not exist, has no config.json, or it is not JSON.
    """
    if not os.path.isdir(path):
        raise ModelFormatError(f"{path}: not a folder (expected a Hugging Face model folder)")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ModelFormatError(f"{path}: no {CONFIG_FILE} (expected a Hugging Face model folder "
                               "with config.json and *.safetensors)")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_path}: not valid JSON ({e})") from None


def _tensor_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the files' own headers (the index can lie),
    each file's header checked against its size (:mod:`rlflow.models.weight_files`)."""
    return check_weight_files(path)


def generation_eos_ids(path: str) -> tuple[int, ...]:
    """EOS ids of ``generation_config.json`` in the folder ``path`` (empty when absent)."""
    gen = os.path.join(path, GENERATION_FILE)
    if not os.path.isfile(gen):
        return ()
    with open(gen) as f:
        return eos_token_ids(json.load(f).get("eos_token_id"))


def read_decoder_config(path: str, *, dtype: str | None = None,
                        param_dtype: str | None = None) -> DecoderConfig:
    """The :class:`DecoderConfig` of a HF folder, without reading any weight.

    ``eos_token_ids`` holds config.json's EOS ids plus those of generation_config.json;
    ``dtype`` / ``param_dtype`` default to "float32".

    Raises:
      ModelFormatError: no config.json, or a field is missing / unsupported (names it).
    """
    d = read_hf_config(path)
    cfg = DecoderConfig.from_hf_dict(d, where=os.path.join(path, CONFIG_FILE),
                                     dtype=dtype or "float32", param_dtype=param_dtype or "float32")
    extra_eos = tuple(e for e in generation_eos_ids(path) if e not in cfg.eos_token_ids)
    if extra_eos:
        cfg = cfg.replace(eos_token_ids=cfg.eos_token_ids + extra_eos)
    return cfg


def _read_parameter(tensors: list[HfTensor], shape: tuple, np_dtype, files: dict,
                    handles: dict) -> np.ndarray:
    """One parameter ``shape`` (host, ``np_dtype``) from its HF tensors: the whole array, or
    each tensor into its ``index`` of a stacked one (the per-layer arrays stacked in place:
    one parameter's bytes on the host at a time).

    Raises: ModelFormatError for a tensor whose shape does not match (names it and its file).
    """
    out = None if tensors[0].index == () else np.empty(shape, np_dtype)
    for t in tensors:
        fname = files[t.name]
        try:
            if fname not in handles:
                handles[fname] = safe_open(fname, framework="numpy").__enter__()
            want = shape[len(t.index):]
            hf_shape = tuple(handles[fname].get_slice(t.name).get_shape())
            if hf_shape != _hf_shape(t.kind, want):
                raise ModelFormatError(
                    f"{fname}: tensor {t.name!r} has shape {list(hf_shape)}, expected "
                    f"{list(_hf_shape(t.kind, want))} from {CONFIG_FILE}")
            arr = _to_ours(t.kind, handles[fname].get_tensor(t.name), want).astype(np_dtype)
        except (SafetensorError, OSError) as e:     # damaged after the pre-start check
            raise ModelFormatError(
                f"{fname}: cannot read tensor {t.name!r} ({' '.join(str(e).split())[:200]}) "
                f"(expected a complete safetensors file; was it changed or cut while "
                f"loading?)") from None
        if out is None:
            return arr
        out[t.index] = arr
    return out


def load_hf(path: str, *, dtype: str | None = None, param_dtype: str | None = None,
            mesh: jax.sharding.Mesh | None = None) -> tuple[Decoder, DecoderConfig]:
    """Load a local HF folder (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 text / gpt-oss)
    into a :class:`Decoder`.

    Args:
      path: folder with config.json and safetensors weights (single or sharded).
      dtype: compute dtype ("float32" default, or "bfloat16").
      param_dtype: stored parameter dtype ("float32" default, or "bfloat16").
      mesh: when given, every parameter is created directly in its sharding
        (``rlflow.mesh.param_shardings``), never whole on one device.

    Returns:
      ``(model, cfg)``; ``cfg.eos_token_ids`` holds config.json's EOS ids plus those of
      generation_config.json.

    Raises:
      ModelFormatError: no config.json; unsupported ``model_type`` (lists the supported);
        a weight file missing, truncated or with a bad header
        (:func:`rlflow.models.weight_files.check_weight_files`; names the file); a tensor
        missing from the safetensors files (names it); a tensor whose shape does not match
        config.json (names tensor, file and both shapes).
    """
    cfg = read_decoder_config(path, dtype=dtype, param_dtype=param_dtype)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_params = nnx.split(abstract, nnx.Param)
    shardings = None
    if mesh is not None:
        from rlflow.mesh import param_shardings
        shardings = param_shardings(abs_params, mesh).to_pure_dict()
    files = _tensor_files(path)
    wanted = hf_moe.stored_layout(hf_weight_map(cfg), files) if cfg.is_moe else hf_weight_map(cfg)
    missing = [t.name for t in wanted if t.name not in files]
    if missing:
        raise ModelFormatError(
            f"{path}: tensor {missing[0]!r} is missing from the safetensors files "
            f"({len(missing)} missing in all: {missing[:5]}{' ...' if len(missing) > 5 else ''})")
    known = {t.name for t in wanted} | {"lm_head.weight"}
    unused = sorted(n for n in files if n not in known and not n.endswith(IGNORED_SUFFIXES))
    if unused:
        warnings.warn(f"{path}: ignoring {len(unused)} tensors rlflow does not use: {unused[:5]}")

    abs_pure = abs_params.to_pure_dict()
    np_dtype = _NP_DTYPES[cfg.param_dtype]
    by_path: dict[tuple, list[HfTensor]] = {}
    for t in wanted:
        by_path.setdefault(t.path, []).append(t)
    loaded: dict = {}
    handles: dict = {}
    try:
        for ours, tensors in by_path.items():    # one parameter (stacked: all its layers) at a time
            shape = tuple(_get(abs_pure, ours).shape)
            arr = _read_parameter(tensors, shape, np_dtype, files, handles)
            if shardings is None:
                value = jnp.asarray(arr)
            else:
                value = jax.make_array_from_callback(shape, _get(shardings, ours),
                                                     lambda idx, a=arr: a[idx])
            _set(loaded, ours, value)
            del arr
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    nnx.replace_by_pure_dict(abs_params, loaded)
    return nnx.merge(graphdef, abs_params), cfg


# ------------------------------------------------------------------------------ writing
def write_hf(params, cfg: DecoderConfig, out_dir: str, *, tokenizer_dir: str | None = None,
             dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
             source_dir: str | None = None) -> None:
    """Write parameters as a HF folder that ``AutoModelForCausalLM.from_pretrained`` loads.

    Args:
      params: ``nnx.State`` of the decoder's ``nnx.Param`` (``nnx.split(model, nnx.Param)``)
        or the same tree as a nested dict of arrays (e.g. restored by orbax).
      cfg: the model's :class:`DecoderConfig`.
      out_dir: created if missing; existing weight files in it are overwritten.
      tokenizer_dir: folder whose tokenizer files are copied (``TOKENIZER_FILES``).
      dtype: stored dtype ("float32" / "bfloat16"); default ``cfg.param_dtype``.
      max_shard_bytes: above this total, weights are split into numbered files + index.
      source_dir: the HF folder the parameters came from: its ``generation_config.json`` is
        kept as it is and its ``config.json`` keys that rlflow does not own are kept
        (:mod:`rlflow.models.hf_settings`). None: rlflow writes both files alone.

    Tied models write no ``lm_head.weight`` and keep ``tie_word_embeddings: true``.

    Raises:
      ModelFormatError: ``dtype`` is unknown, a parameter is missing from ``params``,
        or ``tokenizer_dir`` has no tokenizer files.
    """
    dtype = dtype or cfg.param_dtype
    if dtype not in _NP_DTYPES:
        raise ModelFormatError(f"dtype: must be one of {sorted(_NP_DTYPES)}, got {dtype!r}")
    pure = params.to_pure_dict() if isinstance(params, nnx.State) else params
    tensors, host, parts = {}, {}, {}
    for t in hf_weight_map(cfg):
        if t.path not in host:          # a stacked parameter is fetched once, for all layers
            try:
                value = _get(pure, t.path)
            except (KeyError, TypeError):
                raise ModelFormatError(f"params: missing {'.'.join(map(str, t.path))} "
                                       f"(for HF tensor {t.name!r})") from None
            host[t.path] = np.asarray(jax.device_get(value)).astype(_NP_DTYPES[dtype])
        part = _to_hf(t.kind, host[t.path][t.index])
        if t.kind in hf_moe.INTERLEAVED_KINDS:      # gpt-oss gate_up: gate even, up odd
            parts.setdefault(t.name, [None, None])[hf_moe.INTERLEAVED_KINDS.index(t.kind)] = part
            if any(x is None for x in parts[t.name]):
                continue
            part = np.stack(parts[t.name], axis=-1).reshape(part.shape[:-1] + (-1,))
        elif isinstance(t.kind, hf_qwen35.RowSlice):  # q | k | v rows of one tensor
            part = hf_qwen35.join_rows(parts.setdefault(t.name, {}), t.kind, part)
            if part is None:
                continue
        tensors[t.name] = part
    os.makedirs(out_dir, exist_ok=True)
    _write_safetensors(tensors, out_dir, max_shard_bytes)
    source_cfg = source_gen = None
    if source_dir:
        source_cfg = hf_settings.read_json(os.path.join(source_dir, CONFIG_FILE))
        source_gen = hf_settings.read_json(os.path.join(source_dir, GENERATION_FILE))
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(hf_settings.merge_config(cfg.to_hf_dict(torch_dtype=dtype), source_cfg), f,
                  indent=2, sort_keys=True)
    if source_gen is not None:
        with open(os.path.join(out_dir, GENERATION_FILE), "w") as f:
            json.dump(source_gen, f, indent=2, sort_keys=True)
    else:
        _write_generation_config(cfg, out_dir)
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, out_dir)


def save_hf(model: Decoder, cfg: DecoderConfig, out_dir: str, *, tokenizer_dir: str | None = None,
            dtype: str | None = None, source_dir: str | None = None) -> None:
    """Export a :class:`Decoder` as a HF folder (see :func:`write_hf`)."""
    write_hf(nnx.state(model, nnx.Param), cfg, out_dir, tokenizer_dir=tokenizer_dir, dtype=dtype,
             source_dir=source_dir)


def _write_generation_config(cfg: DecoderConfig, out_dir: str) -> None:
    from transformers import GenerationConfig

    eos = list(cfg.eos_token_ids)
    gen = GenerationConfig(bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id,
                           eos_token_id=(eos[0] if len(eos) == 1 else eos) if eos else None)
    gen.save_pretrained(out_dir)


def copy_tokenizer(tokenizer_dir: str, out_dir: str) -> list[str]:
    """Copy the tokenizer files of ``tokenizer_dir`` into ``out_dir``; returns their names.

    Raises:
      ModelFormatError: ``tokenizer_dir`` holds none of ``TOKENIZER_FILES``.
    """
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, f))]
    if not present:
        raise ModelFormatError(f"{tokenizer_dir}: no tokenizer files (expected one of "
                               f"{', '.join(TOKENIZER_FILES)})")
    for f in present:
        shutil.copyfile(os.path.join(tokenizer_dir, f), os.path.join(out_dir, f))
    return present


# ------------------------------------------------------------------------------ building
def build_model(model_cfg, *, mesh: jax.sharding.Mesh | None = None
                ) -> tuple[Decoder, DecoderConfig]:
    """The policy model of an :class:`rlflow.config.ModelConfig`.

    ``model_cfg.path`` set: :func:`load_hf` with its dtypes; else a random model of the
    architecture fields, seeded by ``model_cfg.init_seed`` (the same values with and
    without ``mesh`` up to float rounding; with one, parameters are initialised directly
    in their shardings).
    """
    if model_cfg.path:
        return load_hf(model_cfg.path, dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype,
                       mesh=mesh)
    cfg = DecoderConfig.from_model_config(model_cfg)

    def init():
        return Decoder(cfg, rngs=nnx.Rngs(params=model_cfg.init_seed))

    if mesh is None:
        return init(), cfg
    from rlflow.mesh import param_shardings
    graphdef, abs_params = nnx.split(nnx.eval_shape(init), nnx.Param)
    params = jax.jit(lambda: nnx.state(init(), nnx.Param),
                     out_shardings=param_shardings(abs_params, mesh))()
    return nnx.merge(graphdef, params), cfg
