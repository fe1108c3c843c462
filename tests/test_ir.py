"""The IR text form (ir_text) and the per-level verifier (verify), as specifications.

Real graphs come from tiny model folders written by hand here (config.json + zero-filled
safetensors: the frontend reads only headers), so nothing imports torch. `write_model` is
shared with test_plan_memory.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import strata_compiler.driver  # noqa: F401  (registers the passes)
from strata_compiler.errors import IRError
from strata_compiler.frontend.hf import build_graph
from strata_compiler.ir import DType, Graph, Level, Node, Op, TensorType, WeightSpec, f32, make_attrs
from strata_compiler.ir_text import parse_graph, print_graph
from strata_compiler.pass_manager import CompileOptions, PassContext, run_pipeline
from strata_compiler.verify import verify

# -- tiny hand-written model folders ---------------------------------------------------------------

_CLASSES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
ARCHS = tuple(_CLASSES)

# name -> (arch, write_model keyword arguments); each variant adds a corner of the IR.
VARIANTS = {
    "llama": ("llama", {}),
    "llama_tied_llama3rope": ("llama", {"tie": True, "n_layers": 3, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {"n_layers": 3}),   # shared expert, qkv bias, layer 1 dense
    "qwen3_moe": ("qwen3_moe", {}),                # per-head q/k norm, head_dim 12 != 32/4
    "olmoe_clip": ("olmoe", {"clip_qkv": 8.0}),    # full q/k norm, clamp
}


def write_model(d: Path, arch: str, *, n_layers: int = 2, tie: bool = False, clip_qkv: float | None = None,
                rope_scaling: dict | None = None) -> Path:
    """A minimal Hugging Face folder for `arch` (zeros; only shapes matter to the frontend)."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    V, D, H, KV = 48, 32, 4, 2
    hd = 12 if arch == "qwen3_moe" else D // H
    E, I, I_DENSE, I_SHARED = 4, 24, 40, 16
    cfg: dict = dict(architectures=[_CLASSES[arch]], vocab_size=V, hidden_size=D, num_hidden_layers=n_layers,
                     num_attention_heads=H, num_key_value_heads=KV, head_dim=hd, rms_norm_eps=1e-6,
                     rope_theta=10000.0, tie_word_embeddings=tie, num_experts_per_tok=2,
                     max_position_embeddings=64, eos_token_id=2, bos_token_id=1)
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    if clip_qkv is not None:
        cfg["clip_qkv"] = clip_qkv
    if arch == "mixtral":
        cfg["num_local_experts"] = E
    elif arch != "llama":
        cfg["num_experts"] = E
    if arch == "qwen2_moe":
        cfg.update(mlp_only_layers=[1], decoder_sparse_step=1, shared_expert_intermediate_size=I_SHARED,
                   qkv_bias=True, norm_topk_prob=False)
    if arch == "qwen3_moe":
        cfg["norm_topk_prob"] = True

    def z(*s):
        return np.zeros(s, np.float32)

    t = {"model.embed_tokens.weight": z(V, D), "model.norm.weight": z(D)}
    if not tie:
        t["lm_head.weight"] = z(V, D)
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        t[p + "input_layernorm.weight"] = z(D)
        t[p + "post_attention_layernorm.weight"] = z(D)
        t[a + "q_proj.weight"], t[a + "k_proj.weight"] = z(H * hd, D), z(KV * hd, D)
        t[a + "v_proj.weight"], t[a + "o_proj.weight"] = z(KV * hd, D), z(D, H * hd)
        if arch == "qwen2_moe":
            t[a + "q_proj.bias"], t[a + "k_proj.bias"], t[a + "v_proj.bias"] = z(H * hd), z(KV * hd), z(KV * hd)
        if arch == "qwen3_moe":
            t[a + "q_norm.weight"], t[a + "k_norm.weight"] = z(hd), z(hd)
        if arch == "olmoe":
            t[a + "q_norm.weight"], t[a + "k_norm.weight"] = z(H * hd), z(KV * hd)
        if arch != "llama" and not (arch == "qwen2_moe" and i == 1):
            pre = p + block + "."
            t[pre + "gate.weight"] = z(E, D)
            for e in range(E):
                t[pre + f"experts.{e}.{names[0]}.weight"] = z(I, D)
                t[pre + f"experts.{e}.{names[1]}.weight"] = z(I, D)
                t[pre + f"experts.{e}.{names[2]}.weight"] = z(D, I)
            if arch == "qwen2_moe":
                s = pre + "shared_expert."
                t[s + "gate_proj.weight"], t[s + "up_proj.weight"] = z(I_SHARED, D), z(I_SHARED, D)
                t[s + "down_proj.weight"] = z(D, I_SHARED)
                t[pre + "shared_expert_gate.weight"] = z(1, D)
        else:
            m = p + "mlp."
            t[m + "gate_proj.weight"], t[m + "up_proj.weight"] = z(I_DENSE, D), z(I_DENSE, D)
            t[m + "down_proj.weight"] = z(D, I_DENSE)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(d / "model.safetensors"))
    return d


TENSOR_PIPELINE = ["lower", "fuse"]
KERNEL_PIPELINE = ["lower", "fuse", "quantize", "select-kernels", "plan-memory"]


def compile_to(g: Graph, pipeline: list[str], quant: str = "f32", place: str = "") -> Graph:
    return run_pipeline(g, pipeline, PassContext(CompileOptions(quant=quant, place=place)))


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[str, Graph]:
    root = tmp_path_factory.mktemp("ir_models")
    out = {}
    for name, (arch, kw) in VARIANTS.items():
        out[name], _ = build_graph(write_model(root / name, arch, **kw))
    return out


# -- print / parse round trip on real graphs -------------------------------------------------------

LEVELS = {
    "graph": lambda g: g,
    "tensor_primitive": lambda g: compile_to(g, ["lower"]),
    "tensor_fused": lambda g: compile_to(g, TENSOR_PIPELINE),
    "tensor_int4": lambda g: compile_to(g, TENSOR_PIPELINE + ["quantize"], "int4"),
    "kernel_int8": lambda g: compile_to(g, KERNEL_PIPELINE, "int8"),
    "kernel_f32": lambda g: compile_to(g, KERNEL_PIPELINE),
    "kernel_mixed": lambda g: compile_to(g, KERNEL_PIPELINE, place="attention=gpu,experts=cpu"),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_real_graph_round_trips(graphs, variant, level):
    g = LEVELS[level](graphs[variant])
    verify(g)
    text = print_graph(g)
    g2 = parse_graph(text)
    assert g2 == g
    assert print_graph(g2) == text
    verify(g2)
    assert text.startswith(f"strata.ir level={g.level.value}\n")
    assert g.level.value == level.split("_")[0]


def test_round_trip_covers_every_op_and_weight_form(graphs):
    """The variants above exercise every op of every level, experts[E] weights and fmt/g."""
    ops: set[Op] = set()
    weight_lines = []
    for g0 in graphs.values():
        for lvl in LEVELS.values():
            g = lvl(g0)
            ops |= {n.op for n in g.nodes}
            weight_lines += [ln for ln in print_graph(g).splitlines() if ln.startswith("weight ")]
    assert ops == set(Op)
    assert any("experts[4](" in ln and "fmt=int4 g=32" in ln for ln in weight_lines)
    assert any("experts[4](" in ln and "fmt=int8 g=32" in ln for ln in weight_lines)
    assert any(", " in ln.split("=", 3)[-1] for ln in weight_lines)  # multi-source (fused) weights


def test_kernel_nodes_print_device_backend_buffer(graphs):
    g = compile_to(graphs["mixtral"], KERNEL_PIPELINE)
    for n, line in zip(g.nodes, (ln for ln in print_graph(g).splitlines() if ln.startswith("%"))):
        assert line.endswith(f" : {n.type} @cpu reference -> %b{n.buffer}")


# -- handcrafted text ------------------------------------------------------------------------------

HANDMADE = r"""strata.ir level=tensor
meta {arch="handmade", eps=1e-06, flags=[true,false], n_layers=2, neg=-3, nested=[[1,2],[],["a"]], none=[], theta=10000.0}
weight @emb f32[16,8] fmt=f32 g=0 = ("model.embed_tokens.weight")
weight @w f32[8,8] fmt=bf16 g=0 = ("a.q_proj.weight", "a.k_proj.weight")
weight @L0.router f32[4,8] fmt=f32 g=0 = ("model.layers.0.mlp.gate.weight")
weight @L0.moe.gate_up f32[4,12,8] fmt=int4 g=32 = experts[4]("model.layers.0.mlp.experts.{e}.gate_proj.weight", "model.layers.0.mlp.experts.{e}.up_proj.weight")
weight @L0.moe.down f32[4,8,6] fmt=int8 g=64 = experts[4]("model.layers.0.mlp.experts.{e}.down_proj.weight")
weight @scalar f32[] fmt=f32 g=0 = ("odd \"quoted\" key\\with\\backslashes")
%0 = input_ids() : i64[B,T]
%1 = embed(%0, table=@emb) : f32[B,T,8]
%2 = linear(%1, w=@w) {alpha=-2.5, big=12345678901234567890, empty=[], eps=1e-06, flag=true, label="say \"hi\", a\\b = {x} (y) } : f32[B]", neg=-3, nested=[[1,2],[],["a",true,0.5,[-1]]], off=false, theta=10000.0, tiny=1e-30, uni="\u00e9\n"} : f32[B,T,8]
%3 = linear(%2, w=@L0.router) : f32[B,T,4]
%4 = route(%3) {k=2, norm=true} : f32[B,T,4]
%5 = moe_ffn(%2, %4, gate_up=@L0.moe.gate_up, down=@L0.moe.down) : f32[B,T,8]
return %5, %3
"""


def test_handmade_text_round_trips_exactly():
    g = parse_graph(HANDMADE)
    assert print_graph(g) == HANDMADE
    assert parse_graph(print_graph(g)) == g
    verify(g)
    n2 = g.node(2)
    assert dict(n2.attrs) == {
        "alpha": -2.5, "big": 12345678901234567890, "empty": (), "eps": 1e-06, "flag": True,
        "label": 'say "hi", a\\b = {x} (y) } : f32[B]', "neg": -3,
        "nested": ((1, 2), (), ("a", True, 0.5, (-1,))), "off": False, "theta": 10000.0, "tiny": 1e-30,
        "uni": "\u00e9\n",
    }
    assert type(n2.attr("flag")) is bool and type(n2.attr("neg")) is int and type(n2.attr("theta")) is float
    assert type(n2.attr("big")) is int
    assert n2.type == f32("B", "T", 8)
    assert n2.weights == (("w", "w"),)
    assert dict(g.meta)["nested"] == ((1, 2), (), ("a",)) and dict(g.meta)["none"] == ()
    gu = g.weight("L0.moe.gate_up")
    assert gu == WeightSpec("L0.moe.gate_up", (4, 12, 8), (
        "model.layers.0.mlp.experts.{e}.gate_proj.weight", "model.layers.0.mlp.experts.{e}.up_proj.weight"),
        4, "int4", 32)
    assert gu.source_keys(3) == ("model.layers.0.mlp.experts.3.gate_proj.weight",
                                 "model.layers.0.mlp.experts.3.up_proj.weight")
    assert len(list(gu.all_source_keys())) == 8
    assert g.weight("L0.moe.down").fmt == "int8" and g.weight("L0.moe.down").group_size == 64
    assert g.weight("w").sources == ("a.q_proj.weight", "a.k_proj.weight") and g.weight("w").fmt == "bf16"
    assert g.weight("scalar").shape == () and g.weight("scalar").sources == ('odd "quoted" key\\with\\backslashes',)
    assert g.outputs == (5, 3)
    assert g.level is Level.TENSOR


def test_handmade_kernel_text_round_trips_exactly():
    text = (
        "strata.ir level=kernel\n"
        "weight @emb f32[16,8] fmt=f32 g=0 = (\"model.embed_tokens.weight\")\n"
        "%0 = input_ids() : i64[B,T] @cpu reference -> %b0\n"
        "%1 = embed(%0, table=@emb) : f32[B,T,8] @gpu xla -> %b12\n"
        "%2 = silu(%1) : f32[B,T,8] @cpu llvm -> %b0\n"
        "return %2\n")
    g = parse_graph(text)
    assert print_graph(g) == text
    verify(g)
    assert [(n.device, n.backend, n.buffer) for n in g.nodes] == [("cpu", "reference", 0), ("gpu", "xla", 12), ("cpu", "llvm", 0)]


@pytest.mark.parametrize("value", [0, -7, 2 ** 70, 0.0, -0.0, 1e-06, 10000.0, -1.5e300, 5e-324, 1e+16, True, False,
                                   "", "#", "%3", 'a"b', "a\\", "line\nbreak\t", "\u2603", "} : f32[B]",
                                   (), ((),), (1, (2, (3, ())), "x", -0.5, False)])
def test_every_attribute_value_round_trips(value):
    n = Node(0, Op.INPUT_IDS, (), TensorType(DType.I64, ("B", "T")), (), make_attrs(v=value))
    g = Graph(Level.TENSOR, (n,), (), (0,), make_attrs(m=value))
    text = print_graph(g)
    g2 = parse_graph(text)
    assert g2 == g
    assert [type(x) for x in _flatten(g2.node(0).attr("v", ()))] == [type(x) for x in _flatten(value)]
    assert print_graph(g2) == text


def _flatten(v):
    if isinstance(v, tuple):
        out = []
        for x in v:
            out += _flatten(x)
        return out
    return [v]


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_infinite_float_attribute_round_trips(value):
    n = Node(0, Op.INPUT_IDS, (), TensorType(DType.I64, ("B", "T")), (), make_attrs(limit=value))
    g = Graph(Level.TENSOR, (n,), (), (0,))
    assert parse_graph(print_graph(g)) == g


def test_empty_graph_and_comments_and_blank_lines():
    g = Graph(Level.GRAPH, (), (), ())
    assert parse_graph(print_graph(g)) == g
    text = "strata.ir level=tensor\n\n# a comment\n%0 = input_ids() : i64[B,T]\n   # indented comment\n\nreturn %0\n"
    assert print_graph(parse_graph(text)) == "strata.ir level=tensor\n%0 = input_ids() : i64[B,T]\nreturn %0\n"


# -- parse errors ----------------------------------------------------------------------------------

GOOD = """strata.ir level=tensor
weight @emb f32[16,8] fmt=f32 g=0 = ("model.embed_tokens.weight")
%0 = input_ids() : i64[B,T]
%1 = embed(%0, table=@emb) : f32[B,T,8]
%2 = rms_norm(%1, w=@emb) {eps=1e-06} : f32[B,T,8]
return %2
"""


def _with_line(lineno: int, line: str) -> str:
    lines = GOOD.splitlines()
    lines[lineno - 1] = line
    return "\n".join(lines) + "\n"


PARSE_ERRORS = [
    # (case, text, line, message fragment)
    ("missing header", GOOD.split("\n", 1)[1], 1, "strata.ir level="),
    ("empty text", "", 1, "strata.ir level="),
    ("unknown level", _with_line(1, "strata.ir level=tile"), 1, "unknown level"),
    ("unknown op", _with_line(4, "%1 = frobnicate(%0, table=@emb) : f32[B,T,8]"), 4, "unknown op 'frobnicate'"),
    ("malformed node", _with_line(4, "%1 = embed(%0, table=@emb : f32[B,T,8]"), 4, "malformed node"),
    ("node without type", _with_line(4, "%1 = embed(%0, table=@emb)"), 4, "malformed node"),
    ("bad attribute value", _with_line(5, "%2 = rms_norm(%1, w=@emb) {eps=1e-06x} : f32[B,T,8]"), 5,
     "bad value for attribute 'eps'"),
    ("bare-word attribute value", _with_line(5, "%2 = rms_norm(%1, w=@emb) {eps=small} : f32[B,T,8]"), 5,
     "bad value for attribute 'eps'"),
    ("object attribute value", _with_line(5, '%2 = rms_norm(%1, w=@emb) {eps={"a": 1}} : f32[B,T,8]'), 5,
     "bad value for attribute 'eps'"),
    ("attribute without =", _with_line(5, "%2 = rms_norm(%1, w=@emb) {eps} : f32[B,T,8]"), 5, "bad attribute"),
    ("bad dtype", _with_line(4, "%1 = embed(%0, table=@emb) : f16[B,T,8]"), 4, "unknown dtype 'f16'"),
    ("bad weight dtype", _with_line(2, 'weight @emb bf16[16,8] fmt=f32 g=0 = ("k")'), 2, "unknown dtype 'bf16'"),
    ("bad dimension", _with_line(4, "%1 = embed(%0, table=@emb) : f32[b,T,8]"), 4, "bad dimension"),
    ("symbolic weight shape", _with_line(2, 'weight @emb f32[V,8] fmt=f32 g=0 = ("k")'), 2, "concrete"),
    ("malformed weight sources", _with_line(2, "weight @emb f32[16,8] fmt=f32 g=0 = (k)"), 2, "weight sources"),
    ("bad operand (number)", _with_line(4, "%1 = embed(0, table=@emb) : f32[B,T,8]"), 4, "bad operand '0'"),
    ("bad operand (weight)", _with_line(4, "%1 = embed(%0, table=emb) : f32[B,T,8]"), 4, "bad operand 'table=emb'"),
    ("bad operand (empty)", _with_line(4, "%1 = embed(%0, , table=@emb) : f32[B,T,8]"), 4, "bad operand"),
    ("malformed return", _with_line(6, "return 2"), 6, "malformed return"),
    ("unparseable line", _with_line(3, "input_ids %0"), 3, "cannot parse"),
]


@pytest.mark.parametrize("case,text,line,fragment", PARSE_ERRORS, ids=[c[0] for c in PARSE_ERRORS])
def test_parse_errors_name_the_line(case, text, line, fragment):
    with pytest.raises(IRError) as ei:
        parse_graph(text, source="fixture.ir")
    msg = str(ei.value)
    assert msg.startswith(f"fixture.ir: line {line}: "), msg
    assert fragment in msg, msg


def test_parse_error_missing_return():
    with pytest.raises(IRError) as ei:
        parse_graph(GOOD.replace("return %2\n", ""), source="fixture.ir")
    msg = str(ei.value)
    assert msg.startswith("fixture.ir: ") and "missing 'return'" in msg


def test_parse_good_fixture():
    g = parse_graph(GOOD)
    verify(g)
    assert print_graph(g) == GOOD


def test_parse_error_line_numbers_count_blank_and_comment_lines():
    text = ("strata.ir level=tensor\n"
            "# a fixture comment\n"
            "\n"
            "%0 = input_ids() : i64[B,T]\n"
            "\n"
            "%1 = frobnicate(%0) : f32[B,T]\n"
            "return %1\n")
    with pytest.raises(IRError, match=r"line 6: unknown op"):
        parse_graph(text)


# -- verify errors ---------------------------------------------------------------------------------

def _expect_invalid(text: str, nid: int, fragment: str, *, marked: str | None = None) -> str:
    """Parse (must succeed), verify (must fail) naming %nid with the IR window, '>>' on that node."""
    g = parse_graph(text)
    with pytest.raises(IRError) as ei:
        verify(g)
    msg = str(ei.value)
    head, _, window = msg.partition("\n")
    assert f"IR invalid at %{nid}:" in head, msg
    assert head.startswith(f"{g.level.value} IR invalid"), msg
    assert fragment in head, msg
    marked_lines = [ln for ln in window.splitlines() if ln.startswith("  >> ")]
    assert len(marked_lines) == 1, msg
    want = marked or next(ln for ln in text.splitlines() if ln.startswith(f"%{nid} = "))
    assert marked_lines[0] == "  >> " + want, msg
    # the window is IR text around the node: every line is a printed node
    assert all(ln[5:].startswith("%") for ln in window.splitlines()), msg
    return msg


T_HEAD = """strata.ir level=tensor
weight @emb f32[16,8] fmt=f32 g=0 = ("model.embed_tokens.weight")
weight @ln f32[8] fmt=f32 g=0 = ("model.norm.weight")
weight @w f32[12,8] fmt=f32 g=0 = ("model.layers.0.mlp.up_proj.weight")
weight @wide f32[12,16] fmt=f32 g=0 = ("model.layers.0.mlp.down_proj.weight")
%0 = input_ids() : i64[B,T]
%1 = embed(%0, table=@emb) : f32[B,T,8]
"""


def _t(*lines: str, ret: str = "return %2", level: str = "tensor") -> str:
    return T_HEAD.replace("level=tensor", f"level={level}") + "".join(ln + "\n" for ln in lines) + ret + "\n"


def test_verify_baseline_is_valid():
    verify(parse_graph(_t("%2 = rms_norm(%1, w=@ln) {eps=1e-06} : f32[B,T,8]")))
    verify(parse_graph(_t("%2 = linear(%1, w=@w) : f32[B,T,12]")))
    verify(parse_graph(_t("%2 = linear(%1, w=@w) {epilogue=\"silu_mul\"} : f32[B,T,6]")))


VERIFY_ERRORS = [
    ("operand used before definition",
     _t("%2 = add(%1, %3) : f32[B,T,8]", "%3 = silu(%1) : f32[B,T,8]"), 2, "operand %3 is not defined before use"),
    ("operand reads itself", _t("%2 = add(%1, %2) : f32[B,T,8]"), 2, "operand %2 is not defined before use"),
    ("undefined operand", _t("%2 = silu(%9) : f32[B,T,8]"), 2, "operand %9 is not defined"),
    ("attention at tensor level",
     _t("%2 = attention(%1, q=@w, k=@w, v=@w, o=@w) {head_dim=2, layer=0, n_heads=4, n_kv_heads=2, qk_norm=\"none\", "
        "rope_theta=10000.0, rope_type=\"default\"} : f32[B,T,8]"), 2, "op 'attention' is not legal at level tensor"),
    ("linear at graph level", _t("%2 = linear(%1, w=@w) : f32[B,T,12]", level="graph"), 2,
     "op 'linear' is not legal at level graph"),
    ("sdpa at graph level",
     _t("%2 = sdpa(%1, %1, %1) {head_dim=2, layer=0, n_heads=4, n_kv_heads=4} : f32[B,T,8]", level="graph"), 2,
     "not legal at level graph"),
    ("wrong operand count", _t("%2 = add(%1) : f32[B,T,8]"), 2, "add takes 2 operands, got 1"),
    ("missing required weight role", _t("%2 = rms_norm(%1) {eps=1e-06} : f32[B,T,8]"), 2,
     "rms_norm needs weight role(s) ['w']"),
    ("unknown role", _t("%2 = linear(%1, w=@w, scale=@ln) : f32[B,T,12]"), 2, "linear takes no weight role(s) ['scale']"),
    ("role given twice", _t("%2 = linear(%1, w=@w, w=@w) : f32[B,T,12]"), 2, "a weight role appears twice"),
    ("undeclared weight", _t("%2 = linear(%1, w=@nope) : f32[B,T,12]"), 2, "weight @nope is not declared"),
    ("missing required attribute", _t("%2 = rms_norm(%1, w=@ln) : f32[B,T,8]"), 2,
     "rms_norm needs attribute(s) ['eps']"),
    ("missing attributes of slice", _t("%2 = slice(%1) {start=0} : f32[B,T,8]"), 2, "needs attribute(s) ['stop']"),
    ("unsorted attrs", _t("%2 = slice(%1) {stop=4, start=0} : f32[B,T,4]"), 2, "attributes must be unique and sorted"),
    ("duplicate attr", _t("%2 = slice(%1) {start=0, start=0, stop=4} : f32[B,T,4]"), 2,
     "attributes must be unique and sorted"),
    ("matmul width mismatch", _t("%2 = linear(%1, w=@wide) : f32[B,T,12]"), 2,
     "weight @wide [12, 16] does not take an input of width 8"),
    ("matmul result width", _t("%2 = linear(%1, w=@w) : f32[B,T,8]"), 2, "result width 8 != 12 from @w"),
    ("silu_mul result width", _t("%2 = linear(%1, w=@w) {epilogue=\"silu_mul\"} : f32[B,T,12]"), 2,
     "result width 12 != 6"),
    ("matmul with 1-D weight", _t("%2 = linear(%1, w=@ln) : f32[B,T,8]"), 2, "does not take an input"),
    ("add shape mismatch", _t("%2 = linear(%1, w=@w) : f32[B,T,12]", "%3 = add(%1, %2) : f32[B,T,8]", ret="return %3"), 3,
     "operand shapes differ"),
    ("input_ids not i64", _t("%2 = input_ids() : f32[B,T]"), 2, "input_ids must be i64"),
    ("i64 activation", _t("%2 = silu(%1) : i64[B,T,8]"), 2, "activations are f32"),
    ("embedding width", _t("%2 = embed(%0, table=@emb) : f32[B,T,4]"), 2, "embedding width mismatch"),
    ("moe_ffn gate+up and gate_up",
     T_HEAD.replace('weight @ln', 'weight @gu f32[2,12,8] fmt=f32 g=0 = experts[2]("e.{e}.w1.weight")\nweight @ln')
     + "%2 = moe_ffn(%1, %1, gate_up=@gu, gate=@gu, up=@gu, down=@gu) : f32[B,T,8]\nreturn %2\n", 2,
     "moe_ffn takes either gate+up or gate_up"),
]


@pytest.mark.parametrize("case,text,nid,fragment", VERIFY_ERRORS, ids=[c[0] for c in VERIFY_ERRORS])
def test_verify_errors_name_the_node_with_ir_window(case, text, nid, fragment):
    _expect_invalid(text, nid, fragment)


def test_verify_duplicate_id_marks_the_duplicate():
    text = _t("%2 = silu(%1) : f32[B,T,8]", "%1 = sigmoid(%2) : f32[B,T,8]")
    _expect_invalid(text, 1, "duplicate id %1", marked="%1 = sigmoid(%2) : f32[B,T,8]")


def test_verify_output_not_defined():
    text = _t("%2 = silu(%1) : f32[B,T,8]", ret="return %2, %7")
    _expect_invalid(text, 2, "output %7 is not defined")


def test_verify_duplicate_weight_names():
    text = _t("%2 = silu(%1) : f32[B,T,8]").replace(
        'weight @ln f32[8]', 'weight @ln f32[8] fmt=f32 g=0 = ("x")\nweight @ln f32[8]')
    _expect_invalid(text, 0, "duplicate weight names")


KERNEL_OK = """strata.ir level=kernel
weight @emb f32[16,8] fmt=f32 g=0 = ("model.embed_tokens.weight")
%0 = input_ids() : i64[B,T] @cpu reference -> %b0
%1 = embed(%0, table=@emb) : f32[B,T,8] @cpu reference -> %b1
%2 = silu(%1) : f32[B,T,8] @cpu reference -> %b0
return %2
"""


@pytest.mark.parametrize("case,line", [
    ("no device/backend", "%1 = embed(%0, table=@emb) : f32[B,T,8] -> %b1"),
    ("no backend", "%1 = embed(%0, table=@emb) : f32[B,T,8] @cpu -> %b1"),
    ("no device", "%1 = embed(%0, table=@emb) : f32[B,T,8] reference -> %b1"),
    ("no buffer", "%1 = embed(%0, table=@emb) : f32[B,T,8] @cpu reference"),
])
def test_verify_kernel_nodes_need_device_backend_buffer(case, line):
    verify(parse_graph(KERNEL_OK))
    text = KERNEL_OK.replace("%1 = embed(%0, table=@emb) : f32[B,T,8] @cpu reference -> %b1", line)
    fragment = "without a buffer" if case == "no buffer" else "without a device and backend"
    _expect_invalid(text, 1, fragment)


def test_verify_real_graphs_and_tampered_real_graph(graphs):
    k = compile_to(graphs["qwen2_moe"], KERNEL_PIPELINE)
    verify(k)
    # drop one node's buffer in a real kernel graph: named, windowed
    victim = k.nodes[7]
    bad = k.with_(nodes=tuple(replace(n, buffer=-1) if n.id == victim.id else n for n in k.nodes))
    _expect_invalid(print_graph(bad), victim.id, "without a buffer")
    # a graph-level model op left in a tensor-level graph
    g = graphs["llama"]
    _expect_invalid(print_graph(g.with_(level=Level.TENSOR)), next(n.id for n in g.nodes if n.op is Op.ATTENTION),
                    "op 'attention' is not legal at level tensor")


def test_ir_window_is_bounded():
    lines = [f"%{i} = silu(%{i - 1}) : f32[B,T,8]" for i in range(2, 20)] + ["%20 = add(%19, %99) : f32[B,T,8]"]
    lines += [f"%{i} = silu(%{i - 1}) : f32[B,T,8]" for i in range(21, 30)]
    msg = _expect_invalid(_t(*lines, ret="return %29"), 20, "operand %99")
    window = msg.split("\n")[1:]
    assert len(window) == 7   # three nodes either side
    assert window[0].endswith("%17 = silu(%16) : f32[B,T,8]") and window[-1].endswith("%23 = silu(%22) : f32[B,T,8]")
    assert re.fullmatch(r" {5}%\d+ = .*", window[0])
