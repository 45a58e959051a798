#!/usr/bin/env python3
"""Compiles every embedded kernel module with NVRTC, without a GPU, to catch compile errors
before a run on the device machine. Uses the same options as the kernel registry.

    python3 scripts/gpu/nvrtc-check.py [--nvrtc PATH/libnvrtc.so.13] [--include DIR] [--arch sm_90]
                                       [--kestrel BIN] [--verbose] [--cubin DIR] [FILE.cu ...]

Each module gets the `-D` definitions the backend compiles it with, as `BIN doctor
--kernel-options` prints them (BIN: target/release/kestrel unless given; build it first).

--cubin writes each module's cubin to DIR, for `cuobjdump -sass` or `nvdisasm` (the
`nvidia-cuda-cuobjdump` / `nvidia-cuda-nvdisasm` wheels).

libnvrtc comes with the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel; the headers
(cuda_fp16.h, cuda_bf16.h) with the toolkit or the `nvidia-cuda-runtime` wheel.
"""
import argparse
import ctypes
import glob
import json
import os
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--nvrtc", default="libnvrtc.so.13")
ap.add_argument("--include", action="append", default=[])
ap.add_argument("--arch", default="sm_90")
ap.add_argument("--verbose", action="store_true", help="print ptxas resource usage (registers, spills)")
ap.add_argument("--cubin", help="write each module's cubin into this folder")
ap.add_argument("--kestrel", help="the kestrel binary whose module definitions to use")
ap.add_argument("files", nargs="*")
args = ap.parse_args()

lib = ctypes.CDLL(args.nvrtc)
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
kernel_dirs = [os.path.join(root, "crates/kestrel-cuda/kernels"), os.path.join(root, "crates/kestrel-cuda-rt/kernels")]
files = args.files or sorted(f for d in kernel_dirs for f in glob.glob(os.path.join(d, "*.cu")))
kestrel = args.kestrel or os.path.join(root, "target/release/kestrel")
listing = json.loads(subprocess.run([kestrel, "doctor", "--kernel-options"], check=True, capture_output=True, text=True).stdout)
defines = {m["name"]: m["defines"] for m in listing["modules"]}
base = [f"--gpu-architecture={args.arch}", "--std=c++17"]
if args.verbose:
    base.append("--ptxas-options=-v")
# The registry hands the headers (kestrel.cuh, pdl.cuh) to NVRTC in memory; here their folders
# stand in for them.
for inc in args.include + kernel_dirs:
    base.append(f"--include-path={inc}")
failed = 0
for path in files:
    stem = os.path.basename(path)[:-3]
    # A file may be compiled as several modules (`skinny.cu` as `skinny.<part>`): each is checked.
    modules = [m for m in defines if m == stem or m.startswith(stem + ".")] or [stem]
    for module in modules:
        opts = base + defines.get(module, [])
        copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        src = open(path, "rb").read()
        prog = ctypes.c_void_p()
        name = os.path.basename(path).encode()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None) == 0
        began = time.monotonic()
        rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
        took = time.monotonic() - began
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        label = os.path.basename(path) if module == stem else f"{os.path.basename(path)} as {module}"
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {label} ({took:.1f} s)", flush=True)
        if text:
            print(text)
        failed += rc != 0
        if rc == 0 and args.cubin:
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, cubin)
            os.makedirs(args.cubin, exist_ok=True)
            out = os.path.join(args.cubin, module + ".cubin")
            open(out, "wb").write(cubin.raw)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
sys.exit(1 if failed else 0)
