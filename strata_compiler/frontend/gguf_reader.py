"""GGUF files (llama.cpp's format) -> the same config and tensors as an HF folder: `llama` (dense, or with
experts: Mixtral), `qwen2moe` (with its shared expert), `qwen3moe` and `olmoe`.

`open_gguf(path)` reads the metadata and tensor directory (gguf_file.py: Strata's own parser, every
count checked against the file and its caps before anything is allocated; the file is mapped and
no tensor data is read up front), checks every `<architecture>.*` size against the tensors it sizes,
and returns

- a `GGUFTensorStore`: a TensorStore look-alike keyed by the Hugging Face names the graph builder
  declares (`model.layers.0.self_attn.q_proj.weight`, ...). Each tensor is dequantized to f32 with
  `gguf.quants.dequantize` one row block at a time when the emit pass streams it, so every GGUF
  type the package can dequantize (F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...) is accepted and
  `--quant` then re-packs the f32 rows into Strata's own formats.
- a `ModelConfig` built from the `<architecture>.*` metadata, for `hf.build_graph`;
- the JSON of a `tokenizers` Tokenizer rebuilt from `tokenizer.ggml.*` (byte-level BPE, model
  `gpt2`), or None when the file's tokenizer is of a kind not rebuilt here.

Layout: GGUF dims are listed innermost first, so a GGUF [in, out] matrix is numpy's [out, in], the
HF layout. llama.cpp's convert_hf_to_gguf.py permutes the rows of q_proj and k_proj (and their
biases) within each head from HF's rotate-half order [2, hd/2] to interleaved pairs [hd/2, 2]
(`LlamaModel.permute`, llama and Mixtral only); `_unpermute` undoes it, so the rest of the compiler
sees HF tensors. A MoE layer's experts are stacked in one tensor per projection (`ffn_gate_exps`
[E, ff, D], ...): each expert is presented under its HF key (`...experts.{e}.w1.weight`) as that
slice of the stacked tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np

from ..errors import ModelError
from ..ir import make_attrs
from ..untrusted import open_regular
from .gguf_file import GGUF_MAGIC, GGUFFile, read_gguf
from .gguf_tokenizer import build_tokenizer_json
from .hf import MAX_DIM, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, ModelConfig, in_range

# GGUF general.architecture -> the HF architecture it maps to (llama with experts: mixtral)
ARCHITECTURES = {"llama": "llama", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
_HF_CLASS = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}

# GGUF tensor name (with N for the block index) -> Hugging Face key.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# MoE tensors, relative to the layer's MoE prefix (block_sparse_moe. for Mixtral, mlp. otherwise)
_MOE_NAMES = {
    "ffn_gate_inp.weight": "gate.weight",
    "ffn_gate_shexp.weight": "shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate.weight",
}
_EXPERT_STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# (GGML type, Strata format, group size) -> that format, where the file's bytes are its arrays as stored
NATIVE = {("Q4_0", "int4", 32): "int4", ("Q8_0", "int8", 32): "int8", ("Q4_1", "int4a", 32): "int4a"}
# bytes of a block's scales ahead of its codes: Q4_0 / Q8_0 d (f16), Q4_1 d and m (f16 each)
_SCALE_BYTES = {"int4": 2, "int8": 2, "int4a": 4}
# the layer index in ASCII digits without leading zeros: blk.00.x, blk.\u0660.x or blk.\uff10.x (which int()
# reads as 0 too) would be a second tensor under blk.0.x's key, replacing it
_BLOCK_RE = re.compile(r"blk\.(0|[1-9][0-9]{0,8})\.(.+)", re.ASCII)
# the store's keys in all: one per tensor, and one per expert of each stacked tensor (DeepSeek-V3 has
# ~45k, Kimi K2 ~70k); a file of a few bytes per expert could otherwise ask for millions
MAX_STORE_KEYS = 1 << 18


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    key: str                  # the Hugging Face key
    file: Path
    dtype: str                # the GGML type name: F32 | F16 | Q4_1 | Q8_0 | ...
    shape: tuple[int, ...]    # numpy / HF order ([out, in] for matrices)
    offset: int
    nbytes: int               # bytes the tensor occupies in the file
    gguf_name: str
    permute_heads: int        # > 0: rows are llama.cpp-permuted q/k rows of this many heads


def _unpermute(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Whole heads of llama.cpp-permuted q/k rows (pairs [hd/2, 2]) -> HF rotate-half rows ([2, hd/2])."""
    shape = rows.shape
    return np.ascontiguousarray(
        rows.reshape((-1, head_dim // 2, 2) + shape[1:]).swapaxes(1, 2).reshape(shape))


class GGUFTensorStore:
    """The tensors of one GGUF file under Hugging Face keys, dequantized to f32 on read."""

    takes_native = True     # iter_row_blocks(native=...): Q4_0 / Q8_0 rows as Strata's own arrays
    typed = True            # info(key).dtype: the file's tensor type (--quant auto keeps it)

    def __init__(self, path: Path, file: GGUFFile, infos: dict[str, GGUFTensorInfo]) -> None:
        self.path, self.file, self.infos = path, file, infos
        # generation.gguf_sampling reads metadata as gguf.GGUFReader offers it: reader.fields[key].contents()
        self.reader = SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v)
                                              for k, v in file.metadata.items()})

    def _bytes(self, t: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as stored, [*shape[:-1], bytes of a row] (a view of the mapped file): the
        layout gguf.quants.dequantize takes, whatever the type."""
        return self.file.view(t.offset, t.nbytes).reshape(t.shape[:-1] + (-1,))

    def __contains__(self, key: str) -> bool:
        return key in self.infos

    def info(self, key: str) -> GGUFTensorInfo:
        return self.infos[key]

    def _head_dim(self, t: GGUFTensorInfo) -> int:
        return t.shape[0] // t.permute_heads

    def read_rows(self, key: str, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of the tensor (along axis 0) as f32; 1-D tensors read whole.

        For permuted q/k tensors r0 and r1 must fall on head boundaries (iter_row_blocks does so)."""
        from gguf.quants import dequantize

        t = self.infos[key]
        data = self._bytes(t)
        data = data if len(t.shape) <= 1 else data[r0:r1]
        with np.errstate(all="ignore"):     # NaN / Inf scales: weights.py refuses them in one line, naming the row
            out = np.array(dequantize(data, _ggml_type(t.dtype)), dtype=np.float32)   # a copy, never the mmap
        out = out.reshape(t.shape if len(t.shape) <= 1 else (-1,) + t.shape[1:])
        if t.permute_heads:
            hd = self._head_dim(t)
            if len(t.shape) > 1 and (r0 % hd or (r1 - r0) % hd):
                raise ValueError(f"{key}: rows [{r0}, {r1}) split a head of {hd} rows")
            out = _unpermute(out, hd)
        return out

    def iter_row_blocks(self, key: str, block_bytes: int = 16 << 20, native: tuple[str, int] | None = None) -> Iterator:
        """The tensor as f32 row blocks of about `block_bytes` (of f32) each (whole heads for q/k).
        With `native` (a Strata format and group size): (block, the same rows in that format's
        stored arrays, or None) pairs — Q4_0 is Strata's int4, Q4_1 its int4a and Q8_0 its int8 in
        groups of 32 bit for bit (same nibble order, f16 scales), so those are taken as they are,
        not requantized."""
        from .safetensors_reader import row_blocks

        t = self.infos[key]
        unit = self._head_dim(t) if t.permute_heads else 1
        if native is None:
            yield from row_blocks(self, key, t.shape, block_bytes, unit)
            return
        same = NATIVE.get((t.dtype, *native)) if len(t.shape) == 2 else None
        yield from row_blocks(self, key, t.shape, block_bytes, unit, read=lambda k, r0, r1: (
            self.read_rows(k, r0, r1), self._native_rows(t, r0, r1, same) if same else None))

    def _native_rows(self, t: GGUFTensorInfo, r0: int, r1: int, fmt: str) -> dict[str, np.ndarray]:
        """Rows [r0, r1) of a Q4_0 / Q4_1 / Q8_0 tensor as Strata int4 / int4a / int8 arrays (groups
        of 32; Q4_1's (d, m) pairs are int4a's interleaved scales)."""
        sb = _SCALE_BYTES[fmt]
        b = np.ascontiguousarray(self._bytes(t)[r0:r1]).reshape(r1 - r0, t.shape[1] // 32, -1)
        scales = np.ascontiguousarray(b[:, :, :sb]).view(np.float16).reshape(r1 - r0, -1)
        qs = np.ascontiguousarray(b[:, :, sb:]).reshape(r1 - r0, -1)
        if fmt == "int8":
            qs = qs.view(np.int8)
        if t.permute_heads:
            hd = self._head_dim(t)
            qs, scales = _unpermute(qs, hd), _unpermute(scales, hd)
        return {"qs": qs, "scales": scales}


# ------------------------------------------------------------------------------------------------
# metadata


class _Meta:
    def __init__(self, path: Path, fields: dict[str, Any]) -> None:
        self.path, self.fields = path, fields

    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        v = self.fields.get(key)
        if v is None:
            if required:
                raise ModelError(f"{self.path}: GGUF metadata {key!r} is missing")
            return default
        ok = (isinstance(v, bool) if kind is bool else isinstance(v, str) if kind is str
              else isinstance(v, list) if kind is list
              else isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer()))
        if not ok:
            raise ModelError(f"{self.path}: GGUF metadata {key!r} should be {kind.__name__}, got {v!r}"[:300])
        if kind is float:   # GGUF stores f32: 1e-5 reads back as 9.99999974e-06; take the shortest f32 decimal
            with np.errstate(over="ignore"):    # an f64 beyond f32 becomes inf, which the range checks refuse
                return float(str(np.float32(v)))
        return int(v) if kind is int else v


@cache
def _ggml_type(name: str) -> Any:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType[name]


@cache
def _dequantizable(name: str) -> bool:
    """Whether gguf.quants.dequantize takes this GGML type (not the integer types I8..I64, F64, Q8_K, ...)."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[_ggml_type(name)][1]), np.uint8), _ggml_type(name))
    except NotImplementedError:
        return False
    return True


def _store(path: Path, gf: GGUFFile, hf_arch: str, n_heads: int, n_kv: int) -> GGUFTensorStore:
    """The file's tensors under HF keys for `hf_arch` (q/k rows to unpermute for llama and Mixtral;
    each expert of a stacked expert tensor under its own key)."""
    moe_pre, expert_names = (("block_sparse_moe.", ("w1", "w3", "w2")) if hf_arch == "mixtral"
                             else ("mlp.", ("gate_proj", "up_proj", "down_proj")))
    permuted = hf_arch in ("llama", "mixtral")
    infos: dict[str, GGUFTensorInfo] = {}
    for t in gf.tensors.values():
        name, shape, dtype = t.name, t.shape, t.ggml_type.name
        if not _dequantizable(dtype):
            raise ModelError(f"{path}: tensor {name} has type {dtype}, which is not a weight type Strata reads "
                             "(F32, F16, BF16, Q4_0 ... Q8_0, K-quants, IQ types)")
        m = _BLOCK_RE.fullmatch(name)
        if name in _GLOBAL_NAMES:
            key = _GLOBAL_NAMES[name]
        elif m and m.group(2) in _BLOCK_NAMES:
            key = f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}"
        elif m and m.group(2) in _MOE_NAMES and hf_arch != "llama":
            key = f"model.layers.{int(m.group(1))}.{moe_pre}{_MOE_NAMES[m.group(2)]}"
            if m.group(2) == "ffn_gate_inp_shexp.weight" and len(shape) == 1:
                shape = (1, shape[0])       # HF's shared_expert_gate is [1, hidden]
        elif m and m.group(2) in _EXPERT_STACKS and hf_arch != "llama":
            if len(shape) != 3 or not 1 <= shape[0] <= MAX_EXPERTS:
                raise ModelError(f"{path}: tensor {name} has shape {list(shape)}; expected [experts, rows, columns]")
            if len(infos) + shape[0] > MAX_STORE_KEYS:
                raise ModelError(f"{path}: tensor {name} brings the file to more than {MAX_STORE_KEYS} tensors "
                                 "and experts; no model Strata compiles has that many")
            proj = expert_names[_EXPERT_STACKS.index(m.group(2))]
            each = t.nbytes // shape[0]
            for e in range(shape[0]):
                key = f"model.layers.{int(m.group(1))}.{moe_pre}experts.{e}.{proj}.weight"
                infos[key] = GGUFTensorInfo(key, path, dtype, shape[1:], t.offset + e * each, each, name, 0)
            continue
        elif name == "rope_freqs.weight":
            raise ModelError(f"{path}: tensor rope_freqs.weight (per-frequency RoPE factors, as in Llama 3.1+) "
                             "is not supported")
        else:
            raise ModelError(f"{path}: tensor {name} is not part of a {hf_arch} model Strata compiles")
        heads = 0
        if permuted and name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k"):
            heads = n_heads if ".attn_q." in name else n_kv
        infos[key] = GGUFTensorInfo(key, path, dtype, shape, t.offset, t.nbytes, name, heads)
    return GGUFTensorStore(path, gf, infos)


def _config(meta: _Meta, store: GGUFTensorStore, arch: str, hf_arch: str) -> ModelConfig:
    path, a = meta.path, arch + "."
    hidden = meta.get(a + "embedding_length", int, required=True)
    n_layers = meta.get(a + "block_count", int, required=True)
    n_heads = meta.get(a + "attention.head_count", int, required=True)
    n_kv = meta.get(a + "attention.head_count_kv", int, default=n_heads)
    for key, v, hi in (("block_count", n_layers, MAX_LAYERS), ("embedding_length", hidden, MAX_DIM),
                       ("attention.head_count", n_heads, MAX_HEADS), ("attention.head_count_kv", n_kv, MAX_HEADS)):
        in_range(path, a + key, v, 1, hi)   # before anything is sized by them
    head_dim = meta.get(a + "attention.key_length", int, default=hidden // n_heads)
    if meta.get(a + "attention.value_length", int, default=head_dim) != head_dim:
        raise ModelError(f"{path}: {a}attention.value_length differs from key_length; not supported")
    if head_dim <= 0 or n_heads % n_kv or head_dim % 2:
        raise ModelError(f"{path}: inconsistent attention sizes (embedding_length={hidden}, "
                         f"head_count={n_heads}, head_count_kv={n_kv}, head_dim={head_dim})")
    in_range(path, a + "attention.key_length", head_dim, 1, MAX_DIM)
    n_experts = in_range(path, a + "expert_count", meta.get(a + "expert_count", int, default=0), 0, MAX_EXPERTS)
    top_k = 0
    if n_experts:
        top_k = in_range(path, a + "expert_used_count", meta.get(a + "expert_used_count", int, required=True),
                         1, n_experts)
    rot = meta.get(a + "rope.dimension_count", int, default=head_dim)
    if rot != head_dim:
        raise ModelError(f"{path}: {a}rope.dimension_count {rot} != head dim {head_dim} (partial RoPE is not supported)")
    rope: dict = {"rope_theta": in_range(path, a + "rope.freq_base", meta.get(a + "rope.freq_base", float, default=10000.0),
                                         0.0, above=True), "rope_type": "default"}
    scaling = meta.get(a + "rope.scaling.type", str, default="none")
    if scaling == "linear":
        rope.update(rope_type="linear", rope_factor=in_range(
            path, a + "rope.scaling.factor", meta.get(a + "rope.scaling.factor", float, required=True), 0.0, above=True))
    elif scaling != "none":
        raise ModelError(f"{path}: {a}rope.scaling.type {scaling!r} is not supported (supported: none, linear)")
    tokens = meta.get("tokenizer.ggml.tokens", list, default=None)
    vocab = meta.get(a + "vocab_size", int, default=len(tokens) if tokens is not None else 0)
    if not vocab and "model.embed_tokens.weight" in store:
        vocab = store.info("model.embed_tokens.weight").shape[0]
    if hf_arch in ("qwen2_moe", "qwen3_moe"):       # MoE where the layer has a router, else a dense MLP
        moe_layers = tuple(f"model.layers.{i}.mlp.gate.weight" in store for i in range(n_layers))
    else:
        moe_layers = (hf_arch != "llama",) * n_layers
    if any(moe_layers) and not n_experts:
        raise ModelError(f"{path}: the file has expert tensors but no {a}expert_count")
    norm_default = hf_arch in ("mixtral", "qwen3_moe")     # llama.cpp's choice for each architecture
    clip = meta.get(a + "attention.clamp_kqv", float, default=0.0)
    in_range(path, a + "vocab_size", vocab, 1, MAX_DIM)
    _check_special_ids(meta, vocab)
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id", int, default=-1) for k in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(e for e in eos if e >= 0))
    bos = meta.get("tokenizer.ggml.bos_token_id", int, default=-1)
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in store
    return ModelConfig(
        arch=hf_arch, architecture=_HF_CLASS[hf_arch], vocab_size=vocab, hidden_size=hidden,
        n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        rms_eps=in_range(path, a + "attention.layer_norm_rms_epsilon",
                         meta.get(a + "attention.layer_norm_rms_epsilon", float, required=True), 0.0, 1.0, above=True),
        rope=make_attrs(**rope),
        tie_word_embeddings="lm_head.weight" not in store,
        moe_layers=moe_layers, n_experts=n_experts if any(moe_layers) else 0, top_k=top_k if any(moe_layers) else 0,
        norm_topk_prob=meta.get(a + "expert_weights_norm", bool, default=norm_default),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(hf_arch, "none"),
        qkv_bias=qkv_bias, o_bias="model.layers.0.self_attn.o_proj.bias" in store,
        shared_expert=any(k.endswith("shared_expert.gate_proj.weight") for k in store.infos),
        clip_qkv=in_range(path, a + "attention.clamp_kqv", clip, 0.0) or None,
        max_position=in_range(path, a + "context_length", meta.get(a + "context_length", int, default=4096), 1,
                              MAX_POSITIONS),
        eos_token_ids=eos_ids,
        bos_token_id=bos,
    )


_SPECIAL_ID = re.compile(r"tokenizer\.ggml\.\w+_token_id")


def _check_special_ids(meta: _Meta, vocab: int) -> None:
    """Every `tokenizer.ggml.*_token_id` (bos, eos, eot, unknown, padding, fim_*, ...): an integer, -1
    (none) or a token of the vocabulary. gguf-py writes no other; one outside would be a stop id that
    never matches, or an index past the token strings."""
    for key, v in meta.fields.items():
        if _SPECIAL_ID.fullmatch(key):
            v = meta.get(key, int)
            if v != -1:
                in_range(meta.path, key, v, 0, vocab - 1)


# ------------------------------------------------------------------------------------------------
# the metadata against the tensors

# GGUF tensor (less its blk.N. prefix) -> its shape, outermost first, each dimension named by the size
# (_sizes) it must equal
_SHAPES = {
    "token_embd.weight": ("vocab", "embd"), "output.weight": ("vocab", "embd"), "output_norm.weight": ("embd",),
    "attn_norm.weight": ("embd",), "ffn_norm.weight": ("embd",),
    "attn_q.weight": ("q", "embd"), "attn_k.weight": ("kv", "embd"), "attn_v.weight": ("kv", "embd"),
    "attn_output.weight": ("embd", "q"),
    "attn_q.bias": ("q",), "attn_k.bias": ("kv",), "attn_v.bias": ("kv",), "attn_output.bias": ("embd",),
    "attn_q_norm.weight": ("q_norm",), "attn_k_norm.weight": ("k_norm",),
    "ffn_gate.weight": ("ff", "embd"), "ffn_up.weight": ("ff", "embd"), "ffn_down.weight": ("embd", "ff"),
    "ffn_gate_inp.weight": ("experts", "embd"),
    "ffn_gate_exps.weight": ("experts", "ff_exp", "embd"), "ffn_up_exps.weight": ("experts", "ff_exp", "embd"),
    "ffn_down_exps.weight": ("experts", "embd", "ff_exp"),
    "ffn_gate_shexp.weight": ("ff_shexp", "embd"), "ffn_up_shexp.weight": ("ff_shexp", "embd"),
    "ffn_down_shexp.weight": ("embd", "ff_shexp"),
    "ffn_gate_inp_shexp.weight": ("embd",),     # llama.cpp writes [n_embd]; HF's [1, hidden] is taken too
}
_ATTENTION = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
              "ffn_norm.weight")
_DENSE = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_MOE = ("ffn_gate_inp.weight",) + _EXPERT_STACKS
_SHARED = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def _sizes(meta: _Meta, cfg: ModelConfig, a: str) -> dict[str, tuple[int | None, str]]:
    """Each named size of _SHAPES -> (its value, None where the file does not give it; what gives it)."""
    def key(name: str, default: int | None = None) -> tuple[int | None, str]:
        v = meta.get(a + name, int, default=default)
        return v, f"{a}{name} is {v}"

    hd, heads, kv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    out = {
        "embd": key("embedding_length"), "vocab": key("vocab_size"), "ff": key("feed_forward_length"),
        "experts": key("expert_count", 0), "ff_exp": key("expert_feed_forward_length"),
        "ff_shexp": key("expert_shared_feed_forward_length"),
        "q": (heads * hd, f"{a}attention.head_count {heads} x head dim {hd} is {heads * hd}"),
        "kv": (kv * hd, f"{a}attention.head_count_kv {kv} x head dim {hd} is {kv * hd}"),
        "hd": (hd, f"the head dim ({a}attention.key_length) is {hd}"),
    }
    if out["ff_exp"][0] is None and cfg.arch in ("mixtral", "olmoe"):    # llama.cpp sizes their experts by n_ff
        out["ff_exp"] = out["ff"]
    # Qwen3-MoE normalizes q and k per head, OLMoE over all heads at once
    out["q_norm"], out["k_norm"] = (out["hd"], out["hd"]) if cfg.qk_norm == "head" else (out["q"], out["kv"])
    return out


def _cross_check(meta: _Meta, gf: GGUFFile, cfg: ModelConfig, arch: str) -> None:
    """Every `<arch>.*` size against the tensors it sizes, and block_count against the layers present:
    the graph is built from the metadata, so a file whose tensors say otherwise would compile to a
    different model (a second layer left out) or fail deep in a pass. One ModelError naming the key
    and the tensor."""
    path, a, n_layers = meta.path, arch + ".", cfg.n_layers
    sizes = _sizes(meta, cfg, a)
    disagree = "the metadata and the tensors disagree: re-convert the model"
    layers: dict[int, set[str]] = {}
    for name, t in gf.tensors.items():
        m = _BLOCK_RE.fullmatch(name)
        if m:
            if int(m.group(1)) >= n_layers:
                raise ModelError(f"{path}: {a}block_count is {n_layers}, but the file holds tensor {name} of layer "
                                 f"{int(m.group(1))}; {disagree}")
            layers.setdefault(int(m.group(1)), set()).add(m.group(2))
        part = m.group(2) if m else name
        shape = t.shape
        if part == "ffn_gate_inp_shexp.weight" and len(shape) == 2 and shape[0] == 1:
            shape = shape[1:]
        dims = _SHAPES.get(part)
        if dims is None:
            continue            # _store has refused anything not in a model Strata compiles
        if len(shape) != len(dims):
            raise ModelError(f"{path}: tensor {name} has shape {list(t.shape)}; a {arch} file holds it with "
                             f"{len(dims)} dimensions")
        for got, dim in zip(shape, dims):
            want, why = sizes[dim]
            if want is None and dim == "ff":
                raise ModelError(f"{path}: GGUF metadata {a + 'feed_forward_length'!r} is missing (it sizes tensor "
                                 f"{name})")
            if want is not None and got != want:
                expect = [sizes[d][0] if sizes[d][0] is not None else g for g, d in zip(shape, dims)]
                raise ModelError(f"{path}: tensor {name} has shape {list(t.shape)}, but {why} (expected "
                                 f"{expect}); {disagree}")
    tokens, embd = meta.get("tokenizer.ggml.tokens", list), gf.tensors.get("token_embd.weight")
    if tokens is not None and embd is not None and len(tokens) != embd.shape[0]:
        raise ModelError(f"{path}: tokenizer.ggml.tokens holds {len(tokens)} tokens, but tensor token_embd.weight has "
                         f"{embd.shape[0]} rows (one per token); {disagree}")
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in gf.tensors:
            raise ModelError(f"{path}: tensor {name} is missing; the file is incomplete")
    for i in range(n_layers):
        have = layers.get(i)
        if not have:
            raise ModelError(f"{path}: {a}block_count (num_hidden_layers) is {n_layers}, but the file holds no tensor "
                             f"of layer {i} (blk.{i}.*); {disagree}")
        need = _ATTENTION + (_MOE if cfg.moe_layers[i] else _DENSE)
        need += ("attn_q.bias", "attn_k.bias", "attn_v.bias") * cfg.qkv_bias
        need += ("attn_q_norm.weight", "attn_k_norm.weight") * (cfg.qk_norm != "none")
        need += _SHARED * (cfg.shared_expert and cfg.moe_layers[i])
        missing = next((n for n in need if n not in have), None)
        if missing:
            raise ModelError(f"{path}: tensor blk.{i}.{missing} is missing (layer {i} of {a}block_count {n_layers}); "
                             "the file is incomplete")


# ------------------------------------------------------------------------------------------------


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file to read as GGUF: named *.gguf (one that is not says so when read),
    or starting with GGUF's magic whatever its name (Ollama keeps models as blobs named by digest)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open_regular(path) as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def open_gguf(path: Path, *, with_chat: bool = False) -> tuple:
    """The tensor store, model config and tokenizer JSON (or None) of a GGUF file; with
    `with_chat`, also its meta["chat"] (chat template and special tokens, frontend/chat.py)."""
    gf = read_gguf(path)
    meta = _Meta(path, gf.metadata)
    arch = meta.get("general.architecture", str, required=True)
    if arch not in ARCHITECTURES:
        raise ModelError(f"{path}: GGUF architecture {arch[:60]!r} is not supported; Strata reads GGUF files of "
                         f"architecture {', '.join(map(repr, ARCHITECTURES))}")
    hf_arch = ARCHITECTURES[arch]
    if hf_arch == "llama" and meta.get("llama.expert_count", int, default=0) > 0:
        hf_arch = "mixtral"         # llama.cpp writes Mixtral as llama with experts
    n_heads = meta.get(f"{arch}.attention.head_count", int, required=True)
    n_kv = meta.get(f"{arch}.attention.head_count_kv", int, default=n_heads)
    if n_heads <= 0 or n_kv <= 0:
        raise ModelError(f"{path}: {arch}.attention.head_count {n_heads} / head_count_kv {n_kv} must be positive")
    store = _store(path, gf, hf_arch, n_heads, n_kv)
    cfg = _config(meta, store, arch, hf_arch)
    _cross_check(meta, gf, cfg, arch)   # q/k rows are now whole heads of an even head dim: _unpermute holds
    if not with_chat:
        return store, cfg, build_tokenizer_json(meta)
    from .chat import gguf_chat

    tokens = meta.get("tokenizer.ggml.tokens", list, default=None)
    chat = gguf_chat(path, meta.get("tokenizer.chat_template", str, default=None), tokens,
                     cfg.bos_token_id, cfg.eos_token_ids)
    return store, cfg, build_tokenizer_json(meta), chat
