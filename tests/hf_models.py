"""Test-side oracle: tiny random Hugging Face MoE models and their reference outputs.

Torch and transformers are used here only as the oracle the product is compared against;
the product never imports them.

    build_model(arch, out_dir, *, dtype="float32", shard_size=None, tie_word_embeddings=False,
                seed=0, **config_overrides) -> out_dir
    load_model(path) -> float32 eval-mode *ForCausalLM (eager attention, eager experts)
    hf_logits(model, input_ids[B, T]) -> f32[B, T, V]
    hf_greedy(model, input_ids[B, T], n_new) -> (i64[B, n_new], f32[B, n_new, V])
    clear_prompts(model, vocab, *, n_prompts, length, n_new=16, rel_gap=0.02, seed=0, batch=1)
        -> list of i64[batch, length]
    checkpoint_tensors(model) -> {safetensors key: live torch view of the model's tensor}
    quantize_dequantize_model(model, fmt, group_size=32)   (in place)

Transformers 5 keeps each MoE layer's experts fused, `mlp.experts.gate_up_proj` f[E, 2I, D]
(gate rows first, then up rows) and `mlp.experts.down_proj` f[E, D, I], and splits them back
into per-expert [out, in] matrices on save (`mlp.experts.{e}.{gate,up,down}_proj.weight`;
Mixtral: `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` and `block_sparse_moe.gate.weight`).
`checkpoint_tensors` undoes that mapping so per-checkpoint-key operations can be applied to the
live model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import transformers  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(int(os.environ.get("STRATA_TEST_TORCH_THREADS", "2")))

ARCHS = ("llama", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    use_cache=True,
)

# One line per architecture; each exercises a different corner of the supported family.
_ARCH_CONFIGS: dict[str, tuple[str, str, dict]] = {
    # Dense baseline: no biases anywhere, head_dim = hidden / heads.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=96, num_hidden_layers=2, intermediate_size=96,
        attention_bias=False, mlp_bias=False, head_dim=None,
    )),
    # Mixtral: explicit head_dim null, 4 experts top-2, I = 40 (not a multiple of 32: padded groups).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=112, num_hidden_layers=2, intermediate_size=40, head_dim=None,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
    )),
    # Qwen2-MoE: q/k/v biases, shared expert with sigmoid gate, layer 1 a dense MLP (intermediate_size),
    # 6 experts top-2 with unnormalised top-k weights.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=120, num_hidden_layers=3, intermediate_size=80, qkv_bias=True,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[1],
        norm_topk_prob=False, use_sliding_window=False,
    )),
    # Qwen3-MoE: head_dim 24 != 64 / 4, per-head q/k RMSNorm, 8 experts top-2, normalised top-k.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=128, num_hidden_layers=2, intermediate_size=96, head_dim=24, attention_bias=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
    )),
    # OLMoE: q/k RMSNorm over the whole projection (q: 64, k: 32 wide), 6 experts top-2, no top-k renorm.
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=104, num_hidden_layers=2, intermediate_size=48, attention_bias=False, clip_qkv=None,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
    )),
}

# Scale applied on top of initializer_range so the logits have a wide spread (std of several units).
_EMBED_SCALE = 4.0
_LM_HEAD_SCALE = 3.0


def arch_config(arch: str, *, tie_word_embeddings: bool = False, **overrides):
    """The transformers config object build_model uses for `arch`."""
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    config_cls, _, specific = _ARCH_CONFIGS[arch]
    kwargs = {**_COMMON, **specific, "tie_word_embeddings": tie_word_embeddings, **overrides}
    return getattr(transformers, config_cls)(**kwargs)


@torch.no_grad()
def _perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights away from 1, biases away from 0, embeddings/lm_head scaled up."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is emb
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1 and "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    emb.mul_(_EMBED_SCALE)
    if not tied:
        head.mul_(_LM_HEAD_SCALE)


def build_model(
    arch: str,
    out_dir: Path,
    *,
    dtype: str = "float32",
    shard_size: str | None = None,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    **overrides,
) -> Path:
    """Build a small random `arch` model, save it (safetensors) into out_dir, return out_dir.

    `shard_size` (e.g. "20KB") forces a sharded checkpoint with model.safetensors.index.json.
    `overrides` are config fields (e.g. num_hidden_layers=3). No tokenizer is written.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    out_dir = Path(out_dir)
    config = arch_config(arch, tie_word_embeddings=tie_word_embeddings, **overrides)
    model_cls = getattr(transformers, _ARCH_CONFIGS[arch][1])
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = model_cls(config)
    finally:
        torch.set_default_dtype(prev)
    gen = torch.Generator().manual_seed(seed + 1)
    _perturb(model, gen)
    model = model.to(_DTYPES[dtype]).eval()
    model.config.dtype = dtype
    kwargs = {"safe_serialization": True}
    if shard_size is not None:
        kwargs["max_shard_size"] = shard_size
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def load_model(path) -> torch.nn.Module:
    """The saved model in float32, eval mode, eager attention and eager (per-expert loop) MoE."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.float().eval()


def _ids(input_ids) -> torch.Tensor:
    a = np.asarray(input_ids)
    if a.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {a.shape}")
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


@torch.no_grad()
def hf_logits(model, input_ids: np.ndarray) -> np.ndarray:
    """One full forward without a cache: f32[B, T, V]."""
    out = model(input_ids=_ids(input_ids), use_cache=False)
    return out.logits.float().numpy()


@torch.no_grad()
def hf_greedy(model, input_ids: np.ndarray, n_new: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding with the KV cache, never stopping at EOS.

    Returns tokens i64[B, n_new] and step_logits f32[B, n_new, V], where step_logits[:, i] are the
    logits whose argmax is tokens[:, i] (i = 0: the prompt's last position).
    """
    ids = _ids(input_ids)
    b = ids.shape[0]
    vocab = model.config.vocab_size
    tokens = np.zeros((b, n_new), dtype=np.int64)
    step_logits = np.zeros((b, n_new, vocab), dtype=np.float32)
    if n_new == 0:
        return tokens, step_logits
    out = model(input_ids=ids, use_cache=True)
    for i in range(n_new):
        logits = out.logits[:, -1, :].float()
        nxt = torch.argmax(logits, dim=-1)
        step_logits[:, i] = logits.numpy()
        tokens[:, i] = nxt.numpy()
        if i + 1 < n_new:
            out = model(input_ids=nxt[:, None], cache=out.cache, use_cache=True)
    return tokens, step_logits


def step_gaps(step_logits: np.ndarray) -> np.ndarray:
    """(top1 - top2) / std over the vocab, for every row and step: f32[..., steps]."""
    top2 = np.sort(step_logits, axis=-1)[..., -2:]
    return (top2[..., 1] - top2[..., 0]) / step_logits.std(axis=-1)


def clear_prompts(
    model,
    vocab: int,
    *,
    n_prompts: int,
    length: int,
    n_new: int = 16,
    rel_gap: float = 0.02,
    seed: int = 0,
    batch: int = 1,
    max_candidates: int = 400,
) -> list[np.ndarray]:
    """Random prompts i64[batch, length] whose greedy continuation is unambiguous.

    A row qualifies when, at the prompt's last position and at each of the n_new greedy steps, the
    top-1 logit beats the top-2 by at least rel_gap * std(logits of that step). Each returned prompt
    is `batch` qualifying rows. Up to max_candidates rows are tried; RuntimeError if too few qualify.
    """
    rng = np.random.default_rng(seed)
    need = n_prompts * batch
    good: list[np.ndarray] = []
    tried = 0
    chunk = 32
    while len(good) < need and tried < max_candidates:
        m = min(chunk, max_candidates - tried)
        cand = rng.integers(0, vocab, size=(m, length), dtype=np.int64)
        tried += m
        # n_new + 1 step logits: the prompt's last position, then after each of n_new generated tokens.
        _, logits = hf_greedy(model, cand, n_new + 1)
        ok = (step_gaps(logits) >= rel_gap).all(axis=-1)
        good.extend(cand[ok])
    if len(good) < need:
        raise RuntimeError(
            f"clear_prompts: only {len(good)} of {need} rows with every greedy gap >= {rel_gap} * std "
            f"in {tried} candidates (length {length}, n_new {n_new})"
        )
    rows = np.stack(good[:need])
    return [rows[i * batch:(i + 1) * batch].copy() for i in range(n_prompts)]


# --------------------------------------------------------------------------------------------
# Checkpoint key <-> live tensor mapping, and quantize/dequantize in place.

def _expert_names(model_type: str) -> tuple[str, str, str, str]:
    """(checkpoint block name, gate, up, down) for a model type's per-expert checkpoint keys."""
    if model_type == "mixtral":
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """Every safetensors key save_pretrained writes -> a live view into the model's tensor.

    Expert matrices are returned as [out, in] views of the fused parameters (writes through).
    A tied lm_head has no key of its own (it is model.embed_tokens.weight).
    """
    model_type = model.config.model_type
    block, gate_n, up_n, down_n = _expert_names(model_type)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # deduplicated: a tied lm_head is not listed
        parts = name.split(".")
        if len(parts) >= 3 and parts[-2] == "experts" and p.ndim == 3:
            mod = model.get_submodule(".".join(parts[:-1]))
            prefix = ".".join(parts[:-3] + [block, "experts"])
            transposed = bool(getattr(mod, "is_transposed", False))
            w = p.data.transpose(1, 2) if transposed else p.data  # -> [E, out, in]
            for e in range(w.shape[0]):
                if parts[-1] == "gate_up_proj":
                    two_i = w.shape[1]
                    if two_i % 2:
                        raise AssertionError(f"{name}: odd fused gate_up width {two_i}")
                    if getattr(mod, "is_concatenated", True):
                        gate, up = w[e, : two_i // 2], w[e, two_i // 2:]
                    else:
                        gate, up = w[e, 0::2], w[e, 1::2]
                    out[f"{prefix}.{e}.{gate_n}.weight"] = gate
                    out[f"{prefix}.{e}.{up_n}.weight"] = up
                elif parts[-1] == "down_proj":
                    out[f"{prefix}.{e}.{down_n}.weight"] = w[e]
                else:
                    raise AssertionError(f"unexpected fused expert parameter {name} {tuple(p.shape)}")
            continue
        if model_type == "mixtral" and ".mlp.gate." in name:
            name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        out[name] = p.data
    return out


@torch.no_grad()
def quantize_dequantize_model(model, fmt: str, group_size: int = 32, *, embed_fmt: str | None = None) -> None:
    """In place: every weight `strata_compiler.formats.quantizes(key)` selects becomes
    get_format(fmt).roundtrip(w[out, in] as f32, group_size), cast back to the model's dtype;
    with `embed_fmt` the token embedding table too (and so a tied lm_head), in that format."""
    from strata_compiler.formats import get_format, quantizes

    for key, t in checkpoint_tensors(model).items():
        if key == "model.embed_tokens.weight" and embed_fmt:
            f = get_format(embed_fmt)
        elif quantizes(key):
            f = get_format(fmt)
        else:
            continue
        if t.ndim != 2:
            raise AssertionError(f"{key}: expected a matrix, got shape {tuple(t.shape)}")
        w = t.detach().to(torch.float32).numpy()
        r = f.roundtrip(np.ascontiguousarray(w), group_size)
        t.copy_(torch.from_numpy(np.ascontiguousarray(r, dtype=np.float32)).to(t.dtype))
