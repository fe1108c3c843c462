"""Write a large synthetic Hugging Face MoE checkpoint folder, streaming, in bounded memory.

    python benchmarks/make_synthetic_model.py OUT_DIR --arch qwen3_moe|mixtral|olmoe \\
        [--size-gb 2.2] [--dtype bf16|f16|f32] [--layers N] [--hidden D] [--experts E] \\
        [--moe-intermediate I] [--vocab V] [--heads H] [--kv-heads KV] [--head-dim HD] \\
        [--top-k K] [--shard-gb 1.0] [--seed 0] [--router-skew S]

Output: config.json, model-0000i-of-0000n.safetensors shards (each <= --shard-gb unless a single
tensor is larger) and model.safetensors.index.json, with the checkpoint key names transformers
uses for the architecture. Weights are random but finite and roughly N(0, 1/fan_in)-sized
(norm weights are ~1); they are meant for compiler memory/throughput benchmarks, not for
generating text.

The safetensors header is written by hand and tensor data is streamed in chunks of at most
CHUNK_ELEMS elements, so memory use is a few tens of MB regardless of model or tensor size.
Values come from a random pool of bf16 bit patterns (built once per run) that every chunk reads
at a random offset with a random sign/mantissa XOR mask, which keeps the generation disk-bound.
Everything is deterministic given the arguments (including --seed).

Unless overridden, dimensions are chosen from --size-gb (see `choose_dims`) and the number of
layers is whatever brings the total closest to --size-gb.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

ARCHS = ("qwen3_moe", "mixtral", "olmoe")
DTYPES = {"bf16": ("BF16", 2), "f16": ("F16", 2), "f32": ("F32", 4)}
GB = 1_000_000_000
CHUNK_ELEMS = 1 << 22  # 4 Mi elements per write (8 MB of bf16)
POOL_ELEMS = 1 << 23  # 8 Mi random bf16 patterns (16 MB)
TRANSFORMERS_VERSION = "5.0.0"


@dataclass(frozen=True)
class Dims:
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    moe_intermediate: int
    top_k: int
    layers: int = 0


# Presets by target size: (min_size_gb, hidden, vocab, heads, kv_heads, experts, moe_intermediate)
PRESETS = [
    (1.0, 2048, 32000, 16, 4, 64, 512),
    (0.1, 1024, 16000, 8, 2, 32, 256),
    (0.0, 256, 4096, 4, 2, 8, 128),
]
DEFAULT_TOP_K = {"qwen3_moe": 8, "mixtral": 2, "olmoe": 8}


# ----------------------------------------------------------------------------- layout


def layer_tensors(arch: str, d: Dims, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) for layer i; kind is 'linear' or 'norm'."""
    D, H, KV, hd, E, I = d.hidden, d.heads, d.kv_heads, d.head_dim, d.experts, d.moe_intermediate
    p = f"model.layers.{i}."
    out = [
        (p + "input_layernorm.weight", (D,), "norm"),
        (p + "self_attn.q_proj.weight", (H * hd, D), "linear"),
        (p + "self_attn.k_proj.weight", (KV * hd, D), "linear"),
        (p + "self_attn.v_proj.weight", (KV * hd, D), "linear"),
        (p + "self_attn.o_proj.weight", (D, H * hd), "linear"),
    ]
    if arch == "qwen3_moe":
        out += [(p + "self_attn.q_norm.weight", (hd,), "norm"),
                (p + "self_attn.k_norm.weight", (hd,), "norm")]
    elif arch == "olmoe":
        out += [(p + "self_attn.q_norm.weight", (H * hd,), "norm"),
                (p + "self_attn.k_norm.weight", (KV * hd,), "norm")]
    out.append((p + "post_attention_layernorm.weight", (D,), "norm"))
    if arch == "mixtral":
        m = p + "block_sparse_moe."
        out.append((m + "gate.weight", (E, D), "linear"))
        for e in range(E):
            q = f"{m}experts.{e}."
            out += [(q + "w1.weight", (I, D), "linear"),
                    (q + "w2.weight", (D, I), "linear"),
                    (q + "w3.weight", (I, D), "linear")]
    else:
        m = p + "mlp."
        out.append((m + "gate.weight", (E, D), "linear"))
        for e in range(E):
            q = f"{m}experts.{e}."
            out += [(q + "gate_proj.weight", (I, D), "linear"),
                    (q + "up_proj.weight", (I, D), "linear"),
                    (q + "down_proj.weight", (D, I), "linear")]
    return out


def all_tensors(arch: str, d: Dims) -> list[tuple[str, tuple[int, ...], str]]:
    out = [("model.embed_tokens.weight", (d.vocab, d.hidden), "embed")]
    for i in range(d.layers):
        out += layer_tensors(arch, d, i)
    out += [("model.norm.weight", (d.hidden,), "norm"),
            ("lm_head.weight", (d.vocab, d.hidden), "linear")]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def choose_dims(arch: str, size_gb: float, itemsize: int, **overrides) -> Dims:
    """Preset dims for `size_gb`, `overrides` (non-None) applied, layers fitted to the size."""
    preset = next(p for p in PRESETS if size_gb >= p[0])
    _, hidden, vocab, heads, kv_heads, experts, moe_i = preset
    o = {k: v for k, v in overrides.items() if v is not None}
    hidden = o.get("hidden", hidden)
    heads = o.get("heads", heads)
    head_dim = hidden // heads if arch == "olmoe" else o.get("head_dim", hidden // heads)
    d = Dims(
        hidden=hidden,
        vocab=o.get("vocab", vocab),
        heads=heads,
        kv_heads=o.get("kv_heads", kv_heads),
        head_dim=head_dim,
        experts=o.get("experts", experts),
        moe_intermediate=o.get("moe_intermediate", moe_i),
        top_k=o.get("top_k", min(DEFAULT_TOP_K[arch], max(1, o.get("experts", experts) // 4))),
        layers=o.get("layers", 0),
    )
    if d.heads % d.kv_heads:
        raise SystemExit(f"--heads {d.heads} is not a multiple of --kv-heads {d.kv_heads}")
    if d.top_k > d.experts:
        raise SystemExit(f"--top-k {d.top_k} > --experts {d.experts}")
    if d.layers <= 0:
        fixed = sum(_numel(s) for _, s, _ in all_tensors(arch, replace(d, layers=0)))
        per_layer = sum(_numel(s) for _, s, _ in layer_tensors(arch, d, 0))
        target = size_gb * GB / itemsize
        d = replace(d, layers=max(1, round((target - fixed) / per_layer)))
    return d


def make_config(arch: str, d: Dims, dtype: str) -> dict:
    torch_dtype = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype]
    common = {
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": torch_dtype,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.moe_intermediate,
        "num_attention_heads": d.heads,
        "num_experts_per_tok": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "output_router_logits": False,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": d.vocab,
    }
    if arch == "qwen3_moe":
        return dict(sorted({
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "head_dim": d.head_dim,
            "intermediate_size": 4 * d.hidden,  # dense MLP size (unused: every layer is MoE)
            "max_position_embeddings": 32768,
            "mlp_only_layers": [],
            "moe_intermediate_size": d.moe_intermediate,
            "norm_topk_prob": True,
            "num_experts": d.experts,
            "num_local_experts": d.experts,  # transformers 5 spelling (num_experts: alias)
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "use_sliding_window": False,
        }.items()))
    if arch == "mixtral":
        return dict(sorted({
            **common,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "head_dim": d.head_dim,
            "max_position_embeddings": 32768,
            "num_local_experts": d.experts,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "router_aux_loss_coef": 0.02,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }.items()))
    return dict(sorted({
        **common,
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "attention_bias": False,
        "clip_qkv": None,
        "max_position_embeddings": 4096,
        "norm_topk_prob": False,
        "num_experts": d.experts,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.01,
    }.items()))


# ----------------------------------------------------------------------------- data


class Filler:
    """Deterministic, cheap random values, as bf16 bit patterns, delivered in chunks."""

    def __init__(self, seed: int, embed_scale: float = 0.02):
        self.embed_scale = embed_scale
        self.rng = np.random.default_rng(seed)
        raw = np.frombuffer(self.rng.bytes(POOL_ELEMS * 2), dtype=np.uint16)
        # sign | 2-bit exponent offset (0..3) | 7-bit mantissa: a value in [2^(k-3), 2^(k+1))
        # once (k - 3 + 127) << 7 is added (k chosen per tensor from its scale).
        self.pool = (raw & np.uint16(0x81FF)).astype(np.uint16)
        self.buf = np.empty(CHUNK_ELEMS, dtype=np.uint16)

    def chunk(self, n: int, kind: str, fan_in: int) -> np.ndarray:
        out = self.buf[:n]
        if kind == "norm":  # 1 + small positive: exponent 127, low mantissa bits
            off = int(self.rng.integers(0, POOL_ELEMS - n + 1))
            np.bitwise_and(self.pool[off:off + n], np.uint16(0x000F), out=out)
            np.bitwise_or(out, np.uint16(0x3F80), out=out)
            return out
        scale = self.embed_scale if kind == "embed" else 1.0 / math.sqrt(fan_in)
        k = round(math.log2(scale))
        off = int(self.rng.integers(0, POOL_ELEMS - n + 1))
        mask = np.uint16(int(self.rng.integers(0, 1 << 16)) & 0x807F)
        np.bitwise_xor(self.pool[off:off + n], mask, out=out)
        np.add(out, np.uint16((k - 3 + 127) << 7), out=out)
        return out


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _encode(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return bits
    f32 = _bf16_to_f32(bits)
    return f32 if dtype == "f32" else f32.astype(np.float16)


def safetensors_header(entries: list[tuple[str, tuple[int, ...]]], st_dtype: str,
                       itemsize: int) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (u64 length + JSON padded to 8) and each tensor's data offsets."""
    hdr: dict = {"__metadata__": {"format": "pt"}}
    offsets = []
    pos = 0
    for name, shape in entries:
        nbytes = _numel(shape) * itemsize
        hdr[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets.append((pos, pos + nbytes))
        pos += nbytes
    js = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, offsets


def plan_shards(tensors, itemsize: int, shard_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for t in tensors:
        nbytes = _numel(t[1]) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _skewed_router(w: np.ndarray, skew: float, seed: int) -> np.ndarray:
    """Router rows (float32, (E, H)) scaled by exp(skew * z_e), z_e ~ N(0, 1) per expert (a new
    draw per layer): an expert with a larger row gets larger logits, so it wins the top-k more
    often — a popularity skew like trained routers show. The measured skew is what calibration
    reports."""
    z = np.random.default_rng(seed).standard_normal(w.shape[0]).astype(np.float32)
    w *= np.exp(skew * z)[:, None]
    return w


def _from_f32(w: np.ndarray, dtype: str) -> np.ndarray:
    w = np.ascontiguousarray(w, np.float32).reshape(-1)
    if dtype == "bf16":
        return (w.view(np.uint32) >> 16).astype(np.uint16)
    return w if dtype == "f32" else w.astype(np.float16)


TOPIC_STRENGTH = (1.0, 0.2, 0.03)     # Topics' embed, head, router


def topic_strength_arg(text: str) -> tuple[float, float, float]:
    """--topic-strength EMBED,HEAD,ROUTER (argparse type)."""
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != 3 or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give three fractions >= 0, EMBED,HEAD,ROUTER "
                                         f"(default {','.join(map(str, TOPIC_STRENGTH))})")
    return vals


class Topics:
    """Topic structure, as trained MoE models show it (OLMoE, Muennighoff et al. 2024, section 5:
    experts specialise by domain, and text stays on its domain): D random unit directions u_d of
    the hidden space; token t belongs to topic t mod D.

      embedding row t   += embed * |row| * u_{t mod D}   (a token carries its topic)
      lm_head row t     += head * |row| * u_{t mod D}    (a hidden state on topic d favours topic
                                                          d's tokens: generation stays on topic)
      router row e      += router * |row| * u_{g(e)}     (in each layer a random 1/D of the
                                                          experts serves topic d: g is a fresh
                                                          permutation per layer)

    A plan calibrated on mixed text then sees a mixture of the topics' hot sets, while one
    generation uses its own topic's: what a static placement cannot follow and a cache can."""

    def __init__(self, n: int, hidden: int, seed: int, embed: float = TOPIC_STRENGTH[0],
                 head: float = TOPIC_STRENGTH[1], router: float = TOPIC_STRENGTH[2]):
        rng = np.random.default_rng(seed + 7919)
        u = rng.standard_normal((n, hidden)).astype(np.float32)
        self.u = u / np.linalg.norm(u, axis=1, keepdims=True)
        self.n, self.hidden = n, hidden
        self.embed, self.head, self.router = embed, head, router

    def rows(self, w: np.ndarray, first: int, strength: float) -> np.ndarray:
        """w: a chunk of a (rows, H) tensor from flat element `first`, float32. Adds strength *
        rms * sqrt(H) * u_{row mod D}: rms * sqrt(H) is a row's norm."""
        h = self.hidden
        idx = first + np.arange(w.size)
        r = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
        w += (strength * r * math.sqrt(h)) * self.u[(idx // h) % self.n, idx % h]
        return w

    def router_rows(self, w: np.ndarray, seed: int) -> np.ndarray:
        """w: (E, H) float32; each row gets its own norm times `router` along its topic."""
        g = np.random.default_rng(seed + 104729).permutation(w.shape[0]) % self.n
        w += self.router * np.linalg.norm(w, axis=1, keepdims=True) * self.u[g]
        return w


def make_synthetic_model(out_dir: Path, arch: str = "qwen3_moe", size_gb: float = 2.2,
                         dtype: str = "bf16", shard_gb: float = 1.0, seed: int = 0,
                         router_skew: float = 0.0, embed_scale: float = 0.02, topics: int = 0,
                         topic_strength: tuple[float, float, float] | None = None, **overrides) -> dict:
    """Write the folder; returns a summary dict (dims, total_bytes, largest tensor, files)."""
    if arch not in ARCHS:
        raise SystemExit(f"unknown --arch {arch!r}; choose from {', '.join(ARCHS)}")
    st_dtype, itemsize = DTYPES[dtype]
    d = choose_dims(arch, size_gb, itemsize, **overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(
        json.dumps(make_config(arch, d, dtype), indent=2) + "\n", encoding="utf-8")

    tensors = all_tensors(arch, d)
    shards = plan_shards(tensors, itemsize, int(shard_gb * GB))
    n = len(shards)
    filler = Filler(seed, embed_scale)
    topic = Topics(topics, d.hidden, seed, *(topic_strength or ())) if topics else None
    weight_map: dict[str, str] = {}
    total = 0
    largest = ("", 0)
    files = []
    for si, shard in enumerate(shards, 1):
        fname = f"model-{si:05d}-of-{n:05d}.safetensors"
        header, offsets = safetensors_header([(nm, sh) for nm, sh, _ in shard], st_dtype, itemsize)
        with open(out_dir / fname, "wb") as f:
            f.write(header)
            for (name, shape, kind), (b, e) in zip(shard, offsets):
                numel = _numel(shape)
                fan_in = shape[-1]
                done = 0
                if ((router_skew or topic) and name.endswith("gate.weight") and len(shape) == 2
                        and numel <= CHUNK_ELEMS):
                    w = _bf16_to_f32(filler.chunk(numel, kind, fan_in)).reshape(shape)
                    if router_skew:
                        w = _skewed_router(w, router_skew, seed + len(weight_map))
                    if topic:
                        w = topic.router_rows(w, seed + len(weight_map))
                    f.write(_from_f32(w, dtype).tobytes())
                    done = numel
                on_topic = topic and (kind == "embed" or name == "lm_head.weight")
                while done < numel:
                    m = min(CHUNK_ELEMS, numel - done)
                    bits = filler.chunk(m, kind, fan_in)
                    if on_topic:
                        w = topic.rows(_bf16_to_f32(bits), done, topic.embed if kind == "embed" else topic.head)
                        f.write(_from_f32(w, dtype).tobytes())
                    else:
                        f.write(_encode(bits, dtype).tobytes())
                    done += m
                weight_map[name] = fname
                total += e - b
                if e - b > largest[1]:
                    largest = (name, e - b)
        files.append(fname)

    index = {
        "metadata": {"total_parameters": total // itemsize, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps(index, indent=2) + "\n", encoding="utf-8")
    summary = {
        "out_dir": str(out_dir),
        "arch": arch,
        "dtype": dtype,
        "dims": asdict(d),
        "total_bytes": total,
        "largest_tensor": largest[0],
        "largest_tensor_bytes": largest[1],
        "files": files,
    }
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Write a large synthetic HF MoE checkpoint (streamed, bounded memory).")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--arch", choices=ARCHS, default="qwen3_moe")
    ap.add_argument("--size-gb", type=float, default=2.2, help="target size, 1 GB = 1e9 bytes")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--shard-gb", type=float, default=1.0, help="max shard size (GB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-skew", type=float, default=0.0,
                    help="scale router rows by exp(S * N(0,1)) per expert: skewed expert popularity (0: none)")
    ap.add_argument("--topics", type=int, default=0,
                    help="D topics: token t belongs to topic t mod D, carries it in its embedding, "
                         "favours its topic's next tokens, and each layer's router sends each topic to "
                         "its own 1/D of the experts (see Topics; 0: none)")
    ap.add_argument("--topic-strength", type=topic_strength_arg, default=None,
                    help="EMBED,HEAD,ROUTER: the fractions of a row's norm along its topic's direction "
                         f"in the embedding, the LM head and the routers (default "
                         f"{','.join(map(str, TOPIC_STRENGTH))})")
    ap.add_argument("--embed-scale", type=float, default=0.02,
                    help="magnitude of the embedding values; about 1 keeps tokens' hidden states apart, so "
                         "routing follows --router-skew (at 0.02 the layers' shared output dominates and a few "
                         "experts take most tokens)")
    for flag in ("layers", "hidden", "experts", "moe-intermediate", "vocab", "heads",
                 "kv-heads", "head-dim", "top-k"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    s = make_synthetic_model(
        a.out_dir, arch=a.arch, size_gb=a.size_gb, dtype=a.dtype, shard_gb=a.shard_gb,
        seed=a.seed, router_skew=a.router_skew, embed_scale=a.embed_scale, topics=a.topics,
        topic_strength=a.topic_strength,
        layers=a.layers, hidden=a.hidden, experts=a.experts,
        moe_intermediate=a.moe_intermediate, vocab=a.vocab, heads=a.heads,
        kv_heads=a.kv_heads, head_dim=a.head_dim, top_k=a.top_k)
    dt = time.perf_counter() - t0
    d = s["dims"]
    print(f"{s['out_dir']}: {s['arch']} {s['dtype']}, {d['layers']} layers, hidden {d['hidden']}, "
          f"{d['experts']} experts x {d['moe_intermediate']}, vocab {d['vocab']}, "
          f"{len(s['files'])} shard(s)")
    print(f"total {s['total_bytes']:,} bytes ({s['total_bytes'] / GB:.3f} GB); largest tensor "
          f"{s['largest_tensor']} = {s['largest_tensor_bytes']:,} bytes; {dt:.1f} s",
          file=sys.stdout)


if __name__ == "__main__":
    main()
