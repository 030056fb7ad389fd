#!/usr/bin/env python3
"""Triton's front end (AST -> TTIR for sm_90) on every kernel launch the interpreter runs, on the CPU.

    PYTHONPATH=<triton> TRITON_INTERPRET=1 python tools/triton_frontend.py tests/test_decode_router.py ...

runs pytest on the given tests (any pytest arguments) with each interpreted launch recorded, then compiles them.
Triton 3.6's interpreter converts one-element arrays to Python ints, which numpy 2.4 refuses ("only 0-dimensional
arrays can be converted to Python scalars"): put numpy < 2.4 beside Triton on that PYTHONPATH
(`pip install --target <triton> numpy==2.3.5`).

Under TRITON_INTERPRET=1 the tests record each launch's specialization (the same binder the GPU path uses); at the
end, a process without the interpreter compiles each distinct one, so code the interpreter runs but the compiler
refuses (a variable whose shape changes across an `if`, say) fails on the CPU instead of on a GPU call. The
interpreter patches triton.language in place, which is why the compiling is done in another process.

With TRITON_FRONTEND_FULL=1 each specialization goes through every stage to a cubin (Triton's own ptxas: no GPU or
CUDA install needed), which also catches what the front end cannot (layouts, lowering, ptxas); ~2x slower."""

from __future__ import annotations

import importlib
import os
import pickle
import sys

ARCH = 90  # sm_90: the H100 and H200
# constexprs a kernel takes as the interpreter needs and the GPU otherwise (grouped_int4.py, decode_attention.py):
# each launch is also compiled with the GPU's values
GPU_CONSTEXPRS = {"NATIVE_CAST": True, "IEEE": False}
# TRITON_FRONTEND_FULL=1 (the module's docstring); TRITON_FRONTEND_SASS=DIR also writes each kernel's SASS there
FULL = os.environ.get("TRITON_FRONTEND_FULL") == "1"
SASS_DIR = os.environ.get("TRITON_FRONTEND_SASS", "")


_binders: dict = {}  # an interpreted kernel -> (its JITFunction, the sm_90 backend, the binder): built once


def record(fn, args: tuple, kwargs: dict, launches: set) -> None:
    """One interpreted launch's specialization for sm_90, as the GPU path's binder computes it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if fn not in _binders:
        jit = JITFunction(fn.fn)  # for its parameters and _pack_args only: nothing is compiled in this process
        backend = make_backend(GPUTarget("cuda", ARCH, 32))
        _binders[fn] = jit, backend, create_function_from_signature(jit.signature, jit.params, backend)
    jit, backend, binder = _binders[fn]
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound_args, specialization, options)
    py = fn.fn
    launches.add(pickle.dumps((py.__module__, py.__name__, py.__code__.co_firstlineno, signature, constexprs, attrs,
                               dict(options.__dict__))))  # fmt: skip


def find_kernel(module: str, name: str, line: int):
    """The JITFunction among a module's globals, in tuples too: some modules build their kernels on first use
    (`_kernels()` / `_kernel()`, so that importing them needs no Triton), which this calls first."""
    from triton.runtime.jit import JITFunction

    scope = vars(importlib.import_module(module))
    for builder in ("_kernels", "_kernel"):
        if callable(scope.get(builder)):
            scope[builder]()
    for value in [v for g in scope.values() for v in (g if isinstance(g, tuple) else (g,))]:
        while value is not None and not isinstance(value, JITFunction):
            value = getattr(value, "fn", None)
        if value is not None and value.fn.__name__ == name and value.fn.__code__.co_firstlineno == line:
            return value
    raise LookupError(f"{module}.{name} (line {line}) is not a Triton kernel among the module's globals")


def compile_all(path: str) -> int:
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", ARCH, 32)
    backend = make_backend(target)
    failures = total = 0
    full: list = []  # (label, compiled kernel) where FULL and SASS_DIR
    with open(path, "rb") as f:
        launches = [pickle.loads(launch) for launch in pickle.load(f)]
    for module, name, line, signature, constexprs, attrs, options in launches:
        options = backend.parse_options(options)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        kernel = find_kernel(module, name, line)
        on_gpu = {(kernel.arg_names.index(k),): v for k, v in GPU_CONSTEXPRS.items() if k in kernel.arg_names}
        for values in [constexprs] + ([{**constexprs, **on_gpu}] if on_gpu else []):
            total += 1
            try:
                source = ASTSource(kernel, signature, values, attrs)
                if FULL:  # every stage to a cubin, ptxas included (Triton's own copy: no GPU, no CUDA install)
                    compiled = triton.compile(source, target=target, options=dict(options.__dict__))
                    if SASS_DIR:
                        full.append((f"{name} {values}", compiled))
                else:
                    source.make_ir(
                        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
                    )
            except Exception as exc:  # noqa: BLE001 (each kernel's error is reported)
                failures += 1
                print(f"FRONT END FAILED {module}.{name} {signature} {values}: {exc}", file=sys.stderr)
    print(f"{'whole pipeline' if FULL else 'front end'} (sm_{ARCH}): {total - failures} of {total} specializations "
          "compiled")  # fmt: skip
    if FULL and SASS_DIR:
        write_sass(full, SASS_DIR)
    return failures


def sass_of(compiled) -> str:  # type: ignore[no-untyped-def]
    """A compiled kernel's SASS, from its cubin by Triton's bundled nvdisasm (no CUDA install needed)."""
    import subprocess
    import tempfile

    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True, text=True, check=True).stdout


def write_sass(kernels: list, out_dir: str) -> None:
    """Each compiled kernel's SASS with its shared memory, one file each."""
    os.makedirs(out_dir, exist_ok=True)
    for i, (label, compiled) in enumerate(kernels):
        header = f"// {label}\n// shared memory {compiled.metadata.shared} bytes\n"
        with open(os.path.join(out_dir, f"kernel_{i:03d}.sass"), "w") as f:
            f.write(header + sass_of(compiled))
    print(f"SASS of {len(kernels)} kernels in {out_dir}")


def main() -> int:
    """In the interpreter: the tests, recording; then this file again, without it, compiling."""
    import subprocess
    import tempfile

    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    launches: set[bytes] = set()  # pickled, so that equal specializations count once
    run = InterpretedFunction.run

    def run_and_record(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        record(self, args, kwargs, launches)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run_and_record
    status = pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *sys.argv[1:]])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        pickle.dump(sorted(launches), f)
        f.flush()
        return int(status) or subprocess.call([sys.executable, __file__, "--compile", f.name], env=env)


if __name__ == "__main__":
    sys.path[:0] = [".", "tests"]
    if sys.argv[1:2] == ["--compile"]:
        sys.exit(1 if compile_all(sys.argv[2]) else 0)
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run under TRITON_INTERPRET=1 (the tests record their launches in the interpreter)")
    sys.exit(main())
