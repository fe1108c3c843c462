"""fused_attention as two kernels: `attn_prep` (norm, clip, RoPE, KV-cache write) and `attn_core`.

The semantic definition is the reference backend's `_fused_attention` (backends/reference/executor.py):

    q, k, v = split(qkv); q, k = rms_norm(q/k, q_norm/k_norm) (qk_norm head|full); clip q, k, v;
    q, k = rope(q), rope(k) at positions past_b + t; cache[b, past_b:past_b+T] = k, v; o = sdpa(q, cache)

Each batch row b has its own position past_b = pasts[b] (its cache length): rows of a continuous
batch decode at ragged positions; a step of T > 1 tokens comes with equal pasts (the caller checks).

attn_prep(H, KV, hd, qk_norm, clip) is parallel over rows r in [0, B*T) (r = b*T + t):
  args: qkv, qnw, knw, qout, kc, vc, T, pasts, cap, ldq, eps(f32), clip(f32), inv_freq
    qkv    f32[B*T, ldq]   q (H*hd) | k (KV*hd) | v (KV*hd)
    qnw    f32[hd] (head) or f32[H*hd] (full) q_norm weight; knw likewise for k (unused for none)
    qout   f32[B*T, H*hd]  the normed, clipped, rotated q
    kc, vc f32[B, KV, cap, hd]  one layer of the KV cache; row r writes position pasts[b] + t
    pasts  i64[B]          each batch row's tokens already in the cache
    inv_freq f32[hd/2]     RoPE inverse frequencies (strata_compiler.rope.rope_inv_freq)
  cos/sin are computed in f32 from f32(pos) * inv_freq, as rope_cos_sin does.

attn_core(H, KV, hd) is parallel over (b, h) pairs p in [0, B*H) (b = p // H, h = p % H):
  args: qout, kc, vc, o, T, pasts, cap, ldo
  For each t < T, query qout[b*T+t, h] attends causally over cache positions [0, pasts[b]+t] of kv head
  h // (H/KV), scale 1/sqrt(hd), o f32[B*T, ldo]. Softmax is online, over blocks of KEY_BLOCK keys:
  the block's scores and their max first, one rescale of the accumulator when the running max
  grows, then p = exp(score - max) and acc += p * v (in column chunks that stay in registers);
  o = acc / sum(p). Scratch: acc f32[hd] and the block's scores live on the stack.
"""

from __future__ import annotations

import math

from ..target import Target
from .common import KernelSource, dims, one_of, require
from .elementwise import NEG_INF, clamp, f32, loop, row_kernel, row_ptr, rsqrt_mean, sumsq

PREP_PARAMS = ("qkv", "qnw", "knw", "qout", "kc", "vc", "T", "pasts", "cap", "ldq", "eps", "clip", "inv_freq")
PREP_POINTERS = {"qkv", "qnw", "knw", "qout", "kc", "vc", "pasts", "inv_freq"}
CORE_PARAMS = ("qout", "kc", "vc", "o", "T", "pasts", "cap", "ldo")
CORE_POINTERS = {"qout", "kc", "vc", "o", "pasts"}
KEY_BLOCK = 16   # keys whose scores attn_core computes before one online-softmax update


def _cache_row(tag: str, base: str, kvh: str, hd: int) -> str:
    """%{tag}.dst = &base[((b*KV + kvh)*cap + pos)*hd] (with %kvb0 = b*KV)."""
    return f"""  %{tag}.co0 = add nsw i64 %kvb0, {kvh}
  %{tag}.co1 = mul nsw i64 %{tag}.co0, %cap
  %{tag}.co2 = add nsw i64 %{tag}.co1, %pos
  %{tag}.co3 = mul nsw i64 %{tag}.co2, {hd}
  %{tag}.dst = getelementptr inbounds float, ptr %{base}, i64 %{tag}.co3"""


def _past() -> str:
    """%past = pasts[%b]: batch row b's position (a load before the loops over hd)."""
    return """  %pastp = getelementptr inbounds i64, ptr %pasts, i64 %b
  %past = load i64, ptr %pastp, align 8"""


def _heads(kernel: str, H: int, KV: int, hd: int) -> None:
    dims(kernel, hi=1 << 12, n_heads=H, n_kv_heads=KV, head_dim=hd)
    require(kernel, H % KV == 0, f"{H} heads are not a multiple of {KV} kv heads")


def attn_prep(H: int, KV: int, hd: int, qk_norm: str, clip: bool, target: Target) -> KernelSource:
    _heads("attn_prep", H, KV, hd)
    require("attn_prep", hd % 2 == 0, f"head_dim {hd} is odd (RoPE rotates halves)")
    one_of("attn_prep", "qk_norm", qk_norm, ("none", "head", "full"))
    one_of("attn_prep", "clip", clip, (True, False))
    half = hd // 2

    def heads(tag: str, count: int, src_off: int, wname: str, full_scale: str) -> str:
        """Norm, clip and rotate the `count` heads at src + src_off, writing each to %{tag}.dst."""
        h = f"%{tag}.h"
        inner = f"""  %{tag}.ho = mul nuw nsw i64 {h}, {hd}
  %{tag}.so = add nuw nsw i64 %{tag}.ho, {src_off}
  %{tag}.src = getelementptr inbounds float, ptr %src, i64 %{tag}.so
"""
        if tag == "q":
            inner += f"  %q.dst = getelementptr inbounds float, ptr %qrow, i64 %q.ho\n"
        else:
            inner += _cache_row(tag, "kc", h, hd) + "\n"
        if qk_norm == "head":
            inner += sumsq(f"{tag}ss", f"%{tag}.src", hd, f"{tag}.s")
            inner += rsqrt_mean(f"{tag}.sc", f"%{tag}.s.out", hd) + "\n"
            inner += f"  %{tag}.wp = getelementptr inbounds float, ptr %{wname}, i64 0\n"
        elif qk_norm == "full":
            inner += f"  %{tag}.sc = fadd float {full_scale}, 0.0\n"
            inner += f"  %{tag}.wp = getelementptr inbounds float, ptr %{wname}, i64 %{tag}.ho\n"
        i = f"%{tag}.i"
        rot = f"""  %{tag}.i2 = add nuw nsw i64 {i}, {half}
  %{tag}.pa = getelementptr inbounds float, ptr %{tag}.src, i64 {i}
  %{tag}.a0 = load float, ptr %{tag}.pa, align 4
  %{tag}.pc = getelementptr inbounds float, ptr %{tag}.src, i64 %{tag}.i2
  %{tag}.c0 = load float, ptr %{tag}.pc, align 4
"""
        a, c = f"%{tag}.a0", f"%{tag}.c0"
        if qk_norm != "none":
            rot += f"""  %{tag}.wpa = getelementptr inbounds float, ptr %{tag}.wp, i64 {i}
  %{tag}.wa = load float, ptr %{tag}.wpa, align 4
  %{tag}.wpc = getelementptr inbounds float, ptr %{tag}.wp, i64 %{tag}.i2
  %{tag}.wc = load float, ptr %{tag}.wpc, align 4
  %{tag}.a1 = fmul float {a}, %{tag}.sc
  %{tag}.a2 = fmul float %{tag}.a1, %{tag}.wa
  %{tag}.c1 = fmul float {c}, %{tag}.sc
  %{tag}.c2 = fmul float %{tag}.c1, %{tag}.wc
"""
            a, c = f"%{tag}.a2", f"%{tag}.c2"
        if clip:
            rot += clamp(a, f"%{tag}.a3", "%clip", "%nclip") + "\n" + clamp(c, f"%{tag}.c3", "%clip", "%nclip") + "\n"
            a, c = f"%{tag}.a3", f"%{tag}.c3"
        rot += f"""  %{tag}.cp = getelementptr inbounds float, ptr %cost, i64 {i}
  %{tag}.cv = load float, ptr %{tag}.cp, align 4
  %{tag}.sp = getelementptr inbounds float, ptr %sint, i64 {i}
  %{tag}.sv = load float, ptr %{tag}.sp, align 4
  %{tag}.ac = fmul float {a}, %{tag}.cv
  %{tag}.cs = fmul float {c}, %{tag}.sv
  %{tag}.o1 = fsub float %{tag}.ac, %{tag}.cs
  %{tag}.cc = fmul float {c}, %{tag}.cv
  %{tag}.as = fmul float {a}, %{tag}.sv
  %{tag}.o2 = fadd float %{tag}.cc, %{tag}.as
  %{tag}.da = getelementptr inbounds float, ptr %{tag}.dst, i64 {i}
  store float %{tag}.o1, ptr %{tag}.da, align 4
  %{tag}.dc = getelementptr inbounds float, ptr %{tag}.dst, i64 %{tag}.i2
  store float %{tag}.o2, ptr %{tag}.dc, align 4"""
        inner += loop(f"{tag}rl", f"{tag}.i", half, rot)
        return loop(f"{tag}hl", f"{tag}.h", count, inner)

    body = f"""  %b = sdiv i64 %m, %T
  %bt = mul nsw i64 %b, %T
  %t = sub nsw i64 %m, %bt
{_past()}
  %pos = add nsw i64 %past, %t
  %posf = sitofp i64 %pos to float
  %kvb0 = mul nsw i64 %b, {KV}
{row_ptr("src", "qkv", "%ldq")}
{row_ptr("qrow", "qout", H * hd)}
""" + loop("tab", "ti", half, """  %fp = getelementptr inbounds float, ptr %inv_freq, i64 %ti
  %fr = load float, ptr %fp, align 4
  %ang = fmul float %posf, %fr
  %cv = call float @llvm.cos.f32(float %ang)
  %sv = call float @llvm.sin.f32(float %ang)
  %cp = getelementptr inbounds float, ptr %cost, i64 %ti
  store float %cv, ptr %cp, align 4
  %sp = getelementptr inbounds float, ptr %sint, i64 %ti
  store float %sv, ptr %sp, align 4""")
    if qk_norm == "full":
        body += sumsq("qfss", "%src", H * hd, "qf") + rsqrt_mean("rq", "%qf.out", H * hd) + "\n"
        body += f"  %ksrc = getelementptr inbounds float, ptr %src, i64 {H * hd}\n"
        body += sumsq("kfss", "%ksrc", KV * hd, "kf") + rsqrt_mean("rk", "%kf.out", KV * hd) + "\n"
    body += heads("q", H, 0, "qnw", "%rq") + heads("k", KV, H * hd, "knw", "%rk")
    vclip = clamp("%v.x0", "%v.x1", "%clip", "%nclip") if clip else "  %v.x1 = fadd float %v.x0, 0.0"
    vinner = _cache_row("v", "vc", "%v.h", hd) + f"""
  %v.ho = mul nuw nsw i64 %v.h, {hd}
  %v.so = add nuw nsw i64 %v.ho, {(H + KV) * hd}
  %v.src = getelementptr inbounds float, ptr %src, i64 %v.so
""" + loop("vrl", "v.i", hd, f"""  %v.p = getelementptr inbounds float, ptr %v.src, i64 %v.i
  %v.x0 = load float, ptr %v.p, align 4
{vclip}
  %v.d = getelementptr inbounds float, ptr %v.dst, i64 %v.i
  store float %v.x1, ptr %v.d, align 4""")
    body += loop("vhl", "v.h", KV, vinner)
    name = f"attn_prep_h{H}_kv{KV}_d{hd}_{qk_norm}{'_clip' if clip else ''}"
    prologue = f"""  %cost = alloca [{half} x float], align 64
  %sint = alloca [{half} x float], align 64
  %nclip = fneg float %clip"""
    return row_kernel(name, PREP_PARAMS, PREP_POINTERS, body, target, floats=frozenset({"eps", "clip"}),
                      prologue=prologue)


def attn_core(H: int, KV: int, hd: int, target: Target) -> KernelSource:
    _heads("attn_core", H, KV, hd)
    rep = H // KV
    scale = f32(math.sqrt(hd))
    dot = loop("dl", "di", hd, """  %qe = getelementptr inbounds float, ptr %qp, i64 %di
  %qv = load float, ptr %qe, align 4
  %ke = getelementptr inbounds float, ptr %kp, i64 %di
  %kv = load float, ptr %ke, align 4
  %pr = fmul reassoc contract float %qv, %kv
  %d.n = fadd reassoc contract float %d, %pr""", accs=[("d", "float", "0.0", "%d.n")])
    rescale = loop("rs", "ri", hd, """  %ra = getelementptr inbounds float, ptr %acc, i64 %ri
  %rv = load float, ptr %ra, align 4
  %rv2 = fmul float %rv, %alpha
  store float %rv2, ptr %ra, align 4""")
    # acc += p * v in column chunks of CH floats (8 vector registers), keys inside: the chunk of the
    # accumulator stays in registers over the block's keys
    lim = target.vector_bits // 4
    CH = max(c for c in range(1, min(hd, lim) + 1) if hd % c == 0)
    axpy = loop("av", "vi", CH, """  %aa = getelementptr inbounds float, ptr %accc, i64 %vi
  %av0 = load float, ptr %aa, align 4
  %ve = getelementptr inbounds float, ptr %vp, i64 %vi
  %vv = load float, ptr %ve, align 4
  %pv = fmul contract float %pe, %vv
  %av1 = fadd contract float %av0, %pv
  store float %av1, ptr %aa, align 4""")
    # a block of up to KEY_BLOCK keys: their scores (independent dots) and the block max first, then one
    # rescale of the accumulator if the max grew, then p = exp(score - max) and acc += p * v per key
    scores = loop("sc", "j", "%nk", f"""  %sj = add nsw i64 %s0, %j
  %so = mul nsw i64 %sj, {hd}
  %kp = getelementptr inbounds float, ptr %kbase, i64 %so
{dot}  %sc = fdiv float %d.out, {scale}
  %scp = getelementptr inbounds float, ptr %scr, i64 %j
  store float %sc, ptr %scp, align 4
  %gt = fcmp ogt float %sc, %bm
  %bm.n = select i1 %gt, float %sc, float %bm""", accs=[("bm", "float", NEG_INF, "%bm.n")])
    # the exp calls get a loop of their own: a call clobbers every vector register, and the
    # accumulator should stay in registers across the value loop
    values = loop("ex", "j2", "%nk", """  %scp2 = getelementptr inbounds float, ptr %scr, i64 %j2
  %sc2 = load float, ptr %scp2, align 4
  %pd = fsub float %sc2, %mx.n
  %pe2 = call float @llvm.exp.f32(float %pd)
  store float %pe2, ptr %scp2, align 4
  %lp.n = fadd float %lp, %pe2""", accs=[("lp", "float", "%l.m", "%lp.n")])
    values += loop("ch", "c", hd // CH, f"""  %cb = mul nuw nsw i64 %c, {CH}
  %accc = getelementptr inbounds float, ptr %acc, i64 %cb
""" + loop("pv", "j3", "%nk", f"""  %sj3 = add nsw i64 %s0, %j3
  %so3 = mul nsw i64 %sj3, {hd}
  %so3c = add nsw i64 %so3, %cb
  %vp = getelementptr inbounds float, ptr %vbase, i64 %so3c
  %pp = getelementptr inbounds float, ptr %scr, i64 %j3
  %pe = load float, ptr %pp, align 4
{axpy}"""))
    keys = f"""  %s0 = mul nsw i64 %kb, {KEY_BLOCK}
  %krem = sub nsw i64 %S, %s0
  %kfull = icmp sgt i64 %krem, {KEY_BLOCK}
  %nk = select i1 %kfull, i64 {KEY_BLOCK}, i64 %krem
{scores}  %grew = fcmp ogt float %bm.out, %mx
  br i1 %grew, label %resc, label %keep
resc:
  %ad = fsub float %mx, %bm.out
  %alpha = call float @llvm.exp.f32(float %ad)
{rescale}  %l.r = fmul float %l, %alpha
  br label %join
keep:
  br label %join
join:
  %mx.n = phi float [%bm.out, %rs.x], [%mx, %keep]
  %l.m = phi float [%l.r, %rs.x], [%l, %keep]
{values}"""
    query = f"""  %r = add nsw i64 %bT, %t
  %qo0 = mul nsw i64 %r, {H * hd}
  %qo = add nsw i64 %qo0, %hoff
  %qp = getelementptr inbounds float, ptr %qout, i64 %qo
  %oo0 = mul nsw i64 %r, %ldo
  %oo = add nsw i64 %oo0, %hoff
  %op = getelementptr inbounds float, ptr %o, i64 %oo
  %pt = add nsw i64 %past, %t
  %S = add nsw i64 %pt, 1
  %nkb0 = add nsw i64 %S, {KEY_BLOCK - 1}
  %nkb = sdiv i64 %nkb0, {KEY_BLOCK}
""" + loop("zl", "zi", hd, """  %za = getelementptr inbounds float, ptr %acc, i64 %zi
  store float 0.0, ptr %za, align 4""") + loop(
        "kbl", "kb", "%nkb", keys, accs=[("mx", "float", NEG_INF, "%mx.n"), ("l", "float", "0.0", "%lp.out")]) + loop(
        "ol", "oi", hd, """  %oa = getelementptr inbounds float, ptr %acc, i64 %oi
  %ov = load float, ptr %oa, align 4
  %ow = fdiv float %ov, %l.out
  %oe = getelementptr inbounds float, ptr %op, i64 %oi
  store float %ow, ptr %oe, align 4""")
    body = f"""  %b = udiv i64 %m, {H}
  %h = urem i64 %m, {H}
  %kvh = udiv i64 %h, {rep}
  %kvb0 = mul nsw i64 %b, {KV}
  %kvb1 = add nsw i64 %kvb0, %kvh
  %kvb2 = mul nsw i64 %kvb1, %cap
  %kvb = mul nsw i64 %kvb2, {hd}
  %kbase = getelementptr inbounds float, ptr %kc, i64 %kvb
  %vbase = getelementptr inbounds float, ptr %vc, i64 %kvb
  %bT = mul nsw i64 %b, %T
{_past()}
  %hoff = mul nuw nsw i64 %h, {hd}
""" + loop("tl", "t", "%T", query, guard=True)
    return row_kernel(f"attn_core_h{H}_kv{KV}_d{hd}", CORE_PARAMS, CORE_POINTERS, body, target,
                      prologue=f"""  %acc = alloca [{hd} x float], align 64
  %scr = alloca [{KEY_BLOCK} x float], align 64""", parallel="heads")
