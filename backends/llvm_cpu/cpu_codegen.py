"""`cpu-codegen`: generate the LLVM IR of every CPU kernel, compile it into the kernel cache.

The llvm backend's own pass (registered with the pass manager; strata_compiler/driver.py puts
it in the pipeline): passes describe work and never reach into a backend, so the one step of the
compile that needs the backend's code generator lives with it. The kernels are specialised to each
op's shapes and weight format. Compiling them here, for the compiling host, means the first
`strata-run` on this machine compiles nothing; on another machine the runtime compiles them once
into its own cache. With `--dump-dir`, each kernel's IR before and after optimisation and its
assembly are written to `<dump>/kernels/<name>.{ll,opt.ll,s}`.
"""

from __future__ import annotations

from strata_compiler.ir import Graph, Level
from strata_compiler.pass_manager import PassContext, register


@register("cpu-codegen", Level.KERNEL)
def cpu_codegen(g: Graph, ctx: PassContext) -> Graph:
    """Generate and compile (into the kernel cache) the LLVM CPU kernels; dump IR and assembly."""
    if not any(n.backend == "llvm" for n in g.nodes):
        return g
    from .executor import kernel_sources
    from .jit import emit_artifacts, library
    from .target import Target

    target = Target.host()
    sources = kernel_sources(g, target)
    lib = library(target)
    for name, ir in sources.items():
        lib.load(ir)
    ctx.analyses.cpu_kernels = {"count": len(sources), "compiled": lib.stats.compiled, "cached": lib.stats.cached}
    if ctx.dump_dir is not None:
        out = ctx.dump_dir / "kernels"
        out.mkdir(parents=True, exist_ok=True)
        for name, ir in sources.items():
            for ext, text in emit_artifacts(ir, target).items():
                (out / f"{name}.{ext}").write_text(text)
    return g
