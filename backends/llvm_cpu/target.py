"""The host CPU as LLVM sees it, and the TargetMachine kernels are compiled for.

On AVX-512 hosts the features string gets `-prefer-256-bit`: the X86 backend otherwise treats
512-bit vectors as illegal in functions that do not ask for them and splits them in two.
The `cpu_features` setting `avx2` (or `Target.host(force="avx2")`) drops every AVX-512 feature, so the
AVX2 code path can be tested on any AVX-512 machine; `Target.named("sapphirerapids")` builds a
target for another CPU (for emitting and checking assembly; such code is not run here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import llvmlite.binding as llvm

from strata_compiler import settings
from strata_compiler.errors import BackendError


@functools.cache
def _init() -> None:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    llvm.initialize_native_asmparser()


@dataclass(frozen=True)
class Target:
    cpu: str
    features: str        # LLVM features string, "+avx2,+fma,..."

    @property
    def avx512(self) -> bool:
        return "+avx512f" in self.features.split(",") and "+avx512bw" in self.features.split(",")

    @property
    def vnni(self) -> bool:
        return "+avx512vnni" in self.features.split(",") and self.avx512

    @property
    def amx(self) -> bool:
        """AMX-INT8 tiles (Target.host keeps the features only where the OS granted them)."""
        f = self.features.split(",")
        return "+amx-tile" in f and "+amx-int8" in f and self.avx512

    @property
    def vector_bits(self) -> int:
        return 512 if self.avx512 else 256

    def key(self) -> str:
        """Identity of the generated code: CPU name, features and the LLVM that compiled it."""
        return f"{self.cpu}|{self.features}|llvm{'.'.join(map(str, llvm.llvm_version_info))}"

    def machine(self) -> llvm.TargetMachine:
        _init()
        t = llvm.Target.from_triple(llvm.get_process_triple())
        return t.create_target_machine(cpu=self.cpu, features=self.features, opt=3, codemodel="jitdefault", jit=True)

    @staticmethod
    def host(force: str | None = None) -> "Target":
        _init()
        force = force or settings.get("cpu_features") or None
        cpu = llvm.get_host_cpu_name()
        feats = [f for f in llvm.get_host_cpu_features().flatten().split(",") if f]
        if force == "avx2":
            feats = [("-" + f[1:]) if f.startswith("+avx512") or f.startswith("+amx") or f.startswith("+avx10") else f
                     for f in feats]
            cpu = "haswell" if cpu in _AVX512_CPUS else cpu
        elif force not in (None, "native"):
            raise BackendError(f"Target.host(force={force!r}): use 'avx2' or 'native'")
        if any(f.startswith("+amx") for f in feats) and not _amx_granted():
            feats = [("-" + f[1:]) if f.startswith("+amx") else f for f in feats]
        if "+avx2" not in feats or "+fma" not in feats:
            raise BackendError(f"the llvm backend needs a CPU with AVX2 and FMA; this one ({cpu}) lacks them: use --backend reference")
        if "+avx512f" in feats:
            feats = [f for f in feats if "prefer-256-bit" not in f] + ["-prefer-256-bit"]
        return Target(cpu, ",".join(sorted(set(feats))))

    @staticmethod
    def named(cpu: str) -> "Target":
        """A target for another CPU, with LLVM's feature set for it (code to inspect, not to run)."""
        _init()
        avx512 = cpu in _AVX512_CPUS
        feats = ["+avx2", "+fma", "+f16c"]
        if avx512:
            feats += ["+avx512f", "+avx512bw", "+avx512vl", "+avx512dq", "-prefer-256-bit"]
            if cpu not in ("skylake-avx512",):
                feats.append("+avx512vnni")
            if cpu in ("sapphirerapids", "emeraldrapids", "graniterapids"):
                feats += ["+amx-tile", "+amx-int8"]
        return Target(cpu, ",".join(sorted(feats)))


@functools.cache
def _amx_granted() -> bool:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA): a process
    must before its first tile instruction. False where it is refused or not Linux."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0      # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


_AVX512_CPUS = ("skylake-avx512", "cascadelake", "cooperlake", "icelake-server", "icelake-client", "tigerlake",
                "rocketlake", "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5")
