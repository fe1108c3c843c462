"""Hugging Face model folders -> graph-level IR.

Reads config.json (normalising the variants real checkpoints and transformers 4/5 write; every
value type- and range-checked, the layer count against the layers the checkpoint holds, before
any work), checks every tensor the architecture needs against the safetensors headers, and builds the
graph: embed, then per layer rms_norm -> attention -> add -> rms_norm -> moe|mlp -> add, then
the final norm and lm_head. No tensor data is read here.

Legend: V = vocab, D = hidden, H = query heads, KV = key/value heads, hd = head dim,
E = experts, I = expert (or MLP) intermediate size.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from ..ir import Graph, GraphBuilder, Level, Op, TensorType, DType, WeightSpec, f32, make_attrs
from ..untrusted import JSONLimitError, load_json, read_regular
from .safetensors_reader import TensorStore

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str                 # key of ARCHITECTURES' values: llama | mixtral | ...
    architecture: str         # the class name in config.json
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope: tuple               # make_attrs(rope_theta=..., rope_type=..., ...) entries
    tie_word_embeddings: bool
    moe_layers: tuple[bool, ...]
    n_experts: int
    top_k: int
    norm_topk_prob: bool
    qk_norm: str              # none | head (per head, weight [hd]) | full (whole projection)
    qkv_bias: bool
    o_bias: bool
    shared_expert: bool
    clip_qkv: float | None
    max_position: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int


MAX_JSON_BYTES = 16 * 1024 * 1024   # tokenizer_config.json may carry a big added_tokens_decoder


def read_json_object(path: Path, missing: str | None = None) -> dict | None:
    """A model folder's JSON file as a dict; None when absent, unless `missing` says why it is needed.
    Only a regular file (a FIFO would block), at most MAX_JSON_BYTES, nested at most MAX_JSON_DEPTH."""
    if not os.path.lexists(path):
        if missing:
            raise ModelError(f"{path}: missing; {missing}")
        return None
    try:
        data = read_regular(path, MAX_JSON_BYTES)
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        obj = load_json(data)
    except JSONLimitError as e:
        raise ModelError(f"{path}: {e}; fix or re-download it") from None
    except ValueError as e:
        raise ModelError(f"{path}: not valid JSON ({e.__class__.__name__} at {getattr(e, 'pos', '?')}); "
                         "fix or re-download it") from None
    if not isinstance(obj, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return obj


# Bounds far above any real checkpoint's (the largest have ~128 layers, 512 experts, a 256k
# vocabulary, a 16k hidden size, 10M positions): config.json is untrusted, and a value it gives
# must not make the compiler loop or allocate before the tensors are checked against it.
MAX_LAYERS = 4096
MAX_DIM = 1 << 24             # vocab, hidden and head sizes
MAX_HEADS = 1 << 12
MAX_EXPERTS = 1 << 16
MAX_POSITIONS = 1 << 30
MAX_TOKEN_IDS = 64            # eos_token_id lists


def _show(v: object) -> str:
    """A config value inside a one-line message: its repr, at most 60 characters."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _field(cfg: dict, path: Path, *names: str, default=None, kind=int, lo=None, hi=None, above=False):
    """The first of `names` that config.json sets, of type `kind` (int, float or bool); numbers
    given must lie in [lo, hi] ((lo, hi] with `above`; finite for floats). `default` when none is set."""
    for n in names:
        if cfg.get(n) is not None:
            v = cfg[n]
            try:
                if kind is bool:
                    if not isinstance(v, bool):
                        raise TypeError
                    return v
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError
                out = kind(v)
                if out != v:
                    raise TypeError
            except (TypeError, ValueError, OverflowError):
                raise ModelError(f"{path}: field {n!r} should be {kind.__name__}, got {_show(v)}") from None
            return in_range(path, n, out, lo, hi, above)
    if default is None:
        raise ModelError(f"{path}: missing field {names[0]!r}")
    return default


def in_range(path: Path, name: str, v, lo, hi=None, above: bool = False):
    """`v` (the value of field `name` in file `path`) if it lies in [lo, hi] ((lo, hi] with
    `above`; finite for floats), else one ModelError naming the field and the range."""
    if lo is None:
        return v
    finite = isinstance(v, int) or math.isfinite(v)
    if finite and (v > lo if above else v >= lo) and (hi is None or v <= hi):
        return v
    want = ("an integer " if isinstance(v, int) else "a finite number ") + f"{'>' if above else '>='} {lo}" + \
        (f" and <= {hi}" if hi is not None else "")
    raise ModelError(f"{path}: field {name!r} is {_show(v)}; it must be {want}")


def _token_ids(value: object, path: Path, name: str, vocab: int, many: bool = True) -> tuple[int, ...]:
    """An id, or with `many` a list of ids, in [0, vocab) (None: no ids)."""
    if value is None:
        return ()
    items = value if isinstance(value, list) and many else [value]
    if len(items) > MAX_TOKEN_IDS or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab
                                             for v in items):
        want = f"a token id or a list of at most {MAX_TOKEN_IDS} token ids" if many else "a token id"
        raise ModelError(f"{path}: field {name!r} is {_show(value)}; it must be {want} in [0, {vocab})")
    return tuple(items)


def _rope(cfg: dict, path: Path) -> tuple:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelError(f"{path}: 'rope_parameters' should be an object")
    merged = {"rope_theta": cfg.get("rope_theta", 10000.0), **params}
    rtype = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rtype, str) or rtype not in ROPE_TYPES:
        raise ModelError(f"{path}: rope_type {_show(rtype)} is not supported (supported: {', '.join(ROPE_TYPES)})")
    theta = _field(merged, path, "rope_theta", kind=float, lo=0.0, above=True)
    extra: dict = {}
    if rtype in ("linear", "llama3"):
        extra["rope_factor"] = _field(merged, path, "factor", kind=float, lo=0.0, above=True)
    if rtype == "llama3":
        low = _field(merged, path, "low_freq_factor", kind=float, lo=0.0, above=True)
        extra.update(rope_low_freq_factor=low,   # llama3 smooths between the two: high > low
                     rope_high_freq_factor=_field(merged, path, "high_freq_factor", kind=float, lo=low, above=True),
                     rope_original_max=_field(merged, path, "original_max_position_embeddings", lo=1,
                                              hi=MAX_POSITIONS))
    return make_attrs(rope_theta=theta, rope_type=rtype, **extra)


def _sliding_window(cfg: dict, path: Path, max_position: int) -> None:
    """Sliding-window attention is not implemented: a config that turns it on (use_sliding_window,
    or Mistral's convention of a sliding_window set without it) for a window shorter than the
    positions is refused; full attention would be silently wrong past the window."""
    use = cfg.get("use_sliding_window")
    if use is None:
        use = cfg.get("sliding_window") is not None
    elif not isinstance(use, bool):
        raise ModelError(f"{path}: field 'use_sliding_window' is {_show(use)}; it must be true or false")
    if not use:
        return
    window = _field(cfg, path, "sliding_window", lo=1, hi=MAX_POSITIONS)
    if window < max_position:
        raise ModelError(f"{path}: sliding-window attention (sliding_window={window} < max_position_embeddings="
                         f"{max_position}) is not supported; set max_position_embeddings to {window} to compile "
                         f"the model for contexts the window covers")


def read_config(model_dir: Path) -> ModelConfig:
    """config.json as a ModelConfig, every value type- and range-checked (one ModelError naming the field)."""
    path = model_dir / "config.json"
    cfg = read_json_object(path, "a Hugging Face model folder needs config.json")
    archs = cfg.get("architectures") or []
    known = [a for a in archs if isinstance(a, str) and a in ARCHITECTURES] if isinstance(archs, list) else []
    if not known:
        raise ModelError(f"{path}: architecture {_show(archs)} is not supported; Strata compiles "
                         f"{', '.join(ARCHITECTURES)}")
    architecture = known[0]
    arch = ARCHITECTURES[architecture]
    hidden = _field(cfg, path, "hidden_size", lo=1, hi=MAX_DIM)
    n_layers = _field(cfg, path, "num_hidden_layers", lo=1, hi=MAX_LAYERS)
    n_heads = _field(cfg, path, "num_attention_heads", lo=1, hi=MAX_HEADS)
    n_kv = _field(cfg, path, "num_key_value_heads", default=n_heads, lo=1, hi=MAX_HEADS)
    head_dim = _field(cfg, path, "head_dim", default=hidden // n_heads, lo=1, hi=MAX_DIM)
    if head_dim <= 0 or n_heads % n_kv:
        raise ModelError(f"{path}: inconsistent attention sizes (hidden_size={hidden}, heads={n_heads}, kv_heads={n_kv})")
    if head_dim % 2:
        raise ModelError(f"{path}: head_dim {head_dim} is odd; rotary position embeddings need an even head size")
    vocab = _field(cfg, path, "vocab_size", lo=1, hi=MAX_DIM)
    n_experts = 0 if arch == "llama" else _field(cfg, path, "num_local_experts", "num_experts",
                                                 lo=0 if arch.startswith("qwen") else 1, hi=MAX_EXPERTS)
    if arch == "mixtral":
        moe_layers = (True,) * n_layers
    elif arch in ("qwen2_moe", "qwen3_moe"):
        step = _field(cfg, path, "decoder_sparse_step", default=1, lo=1, hi=MAX_LAYERS)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ModelError(f"{path}: field 'mlp_only_layers' is {_show(only)}; it must be a list of layer indices")
        moe_layers = tuple(n_experts > 0 and i not in only and (i + 1) % step == 0 for i in range(n_layers))
    else:
        moe_layers = (arch == "olmoe",) * n_layers
    if arch == "llama":
        qkv_bias = o_bias = _field(cfg, path, "attention_bias", default=False, kind=bool)
    elif arch == "qwen2_moe":
        qkv_bias, o_bias = _field(cfg, path, "qkv_bias", default=True, kind=bool), False
    else:
        qkv_bias = _field(cfg, path, "attention_bias", default=False, kind=bool)
        o_bias = qkv_bias and arch != "olmoe"
    clip = _field(cfg, path, "clip_qkv", default=0.0, kind=float, lo=0.0) or None
    max_position = _field(cfg, path, "max_position_embeddings", default=4096, lo=1, hi=MAX_POSITIONS)
    _sliding_window(cfg, path, max_position)
    return ModelConfig(
        arch=arch, architecture=architecture,
        vocab_size=vocab, hidden_size=hidden, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
        rms_eps=_field(cfg, path, "rms_norm_eps", default=1e-6, kind=float, lo=0.0, hi=1.0, above=True),
        rope=_rope(cfg, path),
        tie_word_embeddings=_field(cfg, path, "tie_word_embeddings", default=False, kind=bool),
        moe_layers=moe_layers, n_experts=n_experts,
        top_k=_field(cfg, path, "num_experts_per_tok", default=min(2, n_experts), lo=1, hi=n_experts) if n_experts else 0,
        norm_topk_prob=True if arch == "mixtral" else _field(cfg, path, "norm_topk_prob", default=False, kind=bool),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(arch, "none"),
        qkv_bias=qkv_bias, o_bias=o_bias,
        shared_expert=arch == "qwen2_moe" and _field(cfg, path, "shared_expert_intermediate_size", default=0,
                                                     lo=0, hi=MAX_DIM) > 0,
        clip_qkv=clip,
        max_position=max_position,
        eos_token_ids=_token_ids(cfg.get("eos_token_id"), path, "eos_token_id", vocab),
        bos_token_id=(_token_ids(cfg.get("bos_token_id"), path, "bos_token_id", vocab, many=False) or (-1,))[0],
    )


class _Weights:
    """Declares WeightSpecs after checking each source tensor's shape in the checkpoint."""

    def __init__(self, store: TensorStore, model_dir: Path, cfg: ModelConfig) -> None:
        self.store, self.dir, self.cfg = store, model_dir, cfg
        self.specs: dict[str, WeightSpec] = {}

    def _check(self, key: str, shape: tuple[int, ...], why: str) -> None:
        if key not in self.store:
            raise ModelError(f"{self.dir}: tensor {key} is missing from the checkpoint (needed for {why})")
        got = self.store.info(key).shape
        if got != shape:
            raise ModelError(f"{self.store.info(key).file}: tensor {key} has shape {list(got)}, expected "
                             f"{list(shape)} from config.json ({why})")

    def declare(self, name: str, key: str, shape: tuple[int, ...], why: str, experts: int = 0) -> str:
        for e in range(experts) if experts else (None,):
            self._check(key if e is None else key.replace("{e}", str(e)), shape, why)
        full = (experts,) + shape if experts else shape
        self.specs[name] = WeightSpec(name, full, (key,), experts)
        return name

    def inferred_rows(self, key: str, cols: int, why: str) -> int:
        """Output size of a matrix whose size config.json may not give directly (I)."""
        if key not in self.store:
            raise ModelError(f"{self.dir}: tensor {key} is missing from the checkpoint (needed for {why})")
        shape = self.store.info(key).shape
        if len(shape) != 2 or shape[1] != cols:
            raise ModelError(f"{self.store.info(key).file}: tensor {key} has shape {list(shape)}, expected [I, {cols}] ({why})")
        return shape[0]


_LAYER_KEY = re.compile(r"model\.layers\.(\d{1,9})\.")


def _check_layers_present(store, model_dir: Path, n_layers: int) -> None:
    """The config's layer count against the layers the checkpoint holds tensors of, before any
    per-layer work."""
    present = {int(m.group(1)) for k in store.infos if (m := _LAYER_KEY.match(k))}
    missing = next((i for i in range(n_layers) if i not in present), None)
    if missing is not None:
        raise ModelError(f"{model_dir}: the config gives {n_layers} layers (num_hidden_layers, GGUF: block_count), "
                         f"but the checkpoint holds no tensors of layer {missing} ({len(present)} layers present); "
                         f"fix the layer count or use the complete checkpoint")


def build_graph(model_dir: Path, store: TensorStore | None = None,
                cfg: ModelConfig | None = None) -> tuple[Graph, ModelConfig]:
    """The graph-level IR of a Hugging Face model folder (or of `cfg` and `store` from another frontend)."""
    cfg = cfg or read_config(model_dir)
    store = store or TensorStore.open(model_dir)
    _check_layers_present(store, model_dir, cfg.n_layers)
    W = _Weights(store, model_dir, cfg)
    D, V, H, KV, hd = cfg.hidden_size, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    act = f32("B", "T", D)
    b = GraphBuilder()
    embed = W.declare("embed", "model.embed_tokens.weight", (V, D), "vocab_size x hidden_size")
    ids = b.add(Op.INPUT_IDS, (), TensorType(DType.I64, ("B", "T")))
    x = b.add(Op.EMBED, (ids,), act, weights={"table": embed})
    eps = cfg.rms_eps
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        ln1 = W.declare(f"L{i}.ln1", p + "input_layernorm.weight", (D,), "hidden_size")
        ln2 = W.declare(f"L{i}.ln2", p + "post_attention_layernorm.weight", (D,), "hidden_size")
        why_q, why_kv = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
        attn_w = {
            "q": W.declare(f"L{i}.attn.q", a + "q_proj.weight", (H * hd, D), why_q),
            "k": W.declare(f"L{i}.attn.k", a + "k_proj.weight", (KV * hd, D), why_kv),
            "v": W.declare(f"L{i}.attn.v", a + "v_proj.weight", (KV * hd, D), why_kv),
            "o": W.declare(f"L{i}.attn.o", a + "o_proj.weight", (D, H * hd), "hidden_size x heads*head_dim"),
        }
        if cfg.qkv_bias:
            attn_w["bq"] = W.declare(f"L{i}.attn.bq", a + "q_proj.bias", (H * hd,), "attention bias")
            attn_w["bk"] = W.declare(f"L{i}.attn.bk", a + "k_proj.bias", (KV * hd,), "attention bias")
            attn_w["bv"] = W.declare(f"L{i}.attn.bv", a + "v_proj.bias", (KV * hd,), "attention bias")
        if cfg.o_bias:
            attn_w["bo"] = W.declare(f"L{i}.attn.bo", a + "o_proj.bias", (D,), "attention bias")
        if cfg.qk_norm != "none":
            qn, kn = ((hd,), (hd,)) if cfg.qk_norm == "head" else ((H * hd,), (KV * hd,))
            attn_w["q_norm"] = W.declare(f"L{i}.attn.q_norm", a + "q_norm.weight", qn, "q/k norm")
            attn_w["k_norm"] = W.declare(f"L{i}.attn.k_norm", a + "k_norm.weight", kn, "q/k norm")
        h = b.add(Op.RMS_NORM, (x,), act, weights={"w": ln1}, attrs={"eps": eps})
        attn = b.add(Op.ATTENTION, (h,), act, weights=attn_w, attrs=dict(
            cfg.rope, layer=i, n_heads=H, n_kv_heads=KV, head_dim=hd, qk_norm=cfg.qk_norm, eps=eps,
            clip_qkv=cfg.clip_qkv))
        x = b.add(Op.ADD, (x, attn), act)
        h = b.add(Op.RMS_NORM, (x,), act, weights={"w": ln2}, attrs={"eps": eps})
        if cfg.moe_layers[i]:
            ffn = _moe(b, W, cfg, i, h, act)
        else:
            m = p + "mlp."
            inter = W.inferred_rows(m + "gate_proj.weight", D, "dense MLP")
            ffn = b.add(Op.MLP, (h,), act, weights={
                "gate": W.declare(f"L{i}.mlp.gate", m + "gate_proj.weight", (inter, D), "intermediate_size"),
                "up": W.declare(f"L{i}.mlp.up", m + "up_proj.weight", (inter, D), "intermediate_size"),
                "down": W.declare(f"L{i}.mlp.down", m + "down_proj.weight", (D, inter), "intermediate_size"),
            })
        x = b.add(Op.ADD, (x, ffn), act)
    norm = W.declare("norm", "model.norm.weight", (D,), "hidden_size")
    x = b.add(Op.RMS_NORM, (x,), act, weights={"w": norm}, attrs={"eps": eps})
    if cfg.tie_word_embeddings and "lm_head.weight" not in store:
        head = embed
    else:
        head = W.declare("lm_head", "lm_head.weight", (V, D), "vocab_size x hidden_size")
    logits = b.add(Op.MATMUL, (x,), f32("B", "T", V), weights={"w": head})
    bos = {"bos_token_id": cfg.bos_token_id} if cfg.bos_token_id >= 0 else {}     # -1: the model has none
    meta = make_attrs(
        architecture=cfg.architecture, arch=cfg.arch, vocab_size=V, hidden_size=D, n_layers=cfg.n_layers,
        n_kv_heads=KV, head_dim=hd, max_position=cfg.max_position, eos_token_ids=cfg.eos_token_ids, **bos)
    return Graph(Level.GRAPH, tuple(b.nodes), tuple(W.specs.values()), (logits,), meta), cfg


def _moe(b: GraphBuilder, W: _Weights, cfg: ModelConfig, i: int, h: int, act: TensorType) -> int:
    D, E = cfg.hidden_size, cfg.n_experts
    pre = f"model.layers.{i}." + ("block_sparse_moe." if cfg.arch == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if cfg.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    ek = [pre + "experts.{e}." + n + ".weight" for n in names]
    inter = W.inferred_rows(ek[0].replace("{e}", "0"), D, "expert intermediate size")
    w = {
        "router": W.declare(f"L{i}.moe.router", pre + "gate.weight", (E, D), "num_experts x hidden_size"),
        "gate": W.declare(f"L{i}.moe.gate", ek[0], (inter, D), "experts", experts=E),
        "up": W.declare(f"L{i}.moe.up", ek[1], (inter, D), "experts", experts=E),
        "down": W.declare(f"L{i}.moe.down", ek[2], (D, inter), "experts", experts=E),
    }
    if cfg.shared_expert:
        s = pre + "shared_expert."
        si = W.inferred_rows(s + "gate_proj.weight", D, "shared expert")
        w["shared_gate"] = W.declare(f"L{i}.moe.shared_gate", s + "gate_proj.weight", (si, D), "shared_expert_intermediate_size")
        w["shared_up"] = W.declare(f"L{i}.moe.shared_up", s + "up_proj.weight", (si, D), "shared_expert_intermediate_size")
        w["shared_down"] = W.declare(f"L{i}.moe.shared_down", s + "down_proj.weight", (D, si), "shared_expert_intermediate_size")
        w["shared_expert_gate"] = W.declare(f"L{i}.moe.shared_expert_gate", pre + "shared_expert_gate.weight", (1, D), "shared expert gate")
    return b.add(Op.MOE, (h,), act, weights=w, attrs={"top_k": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob,
                                                      "n_experts": E})
